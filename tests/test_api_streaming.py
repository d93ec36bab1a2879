"""Many concurrent streams, and clients that go away: the engine frees their requests within a step."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.conftest import Server

MODEL = "SmolLM2-135M-Instruct"
LONG = {"model": MODEL, "prompt": "Tell me everything about the ocean.", "max_tokens": 1000, "ignore_eos": True}


def metric(server: Server, name: str) -> float:
    """Summed over the engines (data parallel: one series per engine)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(f"roseinfer:{name}{{"))


def assert_engine_idle_within(server: Server, seconds: float) -> None:
    start = time.monotonic()
    while True:
        running, blocks = metric(server, "num_requests_running"), metric(server, "kv_cache_blocks_in_use")
        if running == 0 and blocks == 0:
            return
        assert time.monotonic() - start < seconds, f"still {running} running, {blocks} blocks after {seconds} s"
        time.sleep(0.05)


def test_64_concurrent_streams(server: Server):
    async def one(client: openai.AsyncOpenAI, i: int):
        stream = await client.completions.create(
            model=MODEL, prompt=f"Story number {i}:", max_tokens=4, temperature=0.8, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip
        text, finish, usage = "", [], None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
            usage = chunk.usage or usage
        return text, finish, usage

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    start = time.monotonic()
    results = asyncio.run(run_all())
    assert len(results) == 64
    for text, finish, usage in results:
        assert finish == ["length"] and usage.completion_tokens == 4 and text
    assert time.monotonic() - start < 90
    assert_engine_idle_within(server, 1.0)


def test_streaming_client_disconnect_aborts_in_engine(server: Server):
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()  # kept referenced: dropping the iterator would close the connection already
        events = 0
        while events < 2:
            events += next(lines).startswith("data: ")
        assert metric(server, "num_requests_running") == 1 and metric(server, "kv_cache_blocks_in_use") > 0
    assert_engine_idle_within(server, 1.0)  # leaving the `with` closed the connection mid-stream


def test_non_streaming_client_disconnect_aborts_in_engine(server: Server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=2.0)
    assert_engine_idle_within(server, 1.0)
    # The server is fine afterwards.
    r = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
