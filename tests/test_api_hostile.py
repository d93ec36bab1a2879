"""Hostile input over HTTP: each request fails alone with an OpenAI-shaped 4xx (never a 500) and slows no other."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import Server
from tests.test_api_streaming import assert_engine_idle_within

MODEL = "SmolLM2-135M-Instruct"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
ERROR_KEYS = {"message", "type", "param", "code"}
STREAM = {"model": MODEL, "prompt": "Tell me about the sea.", "max_tokens": 24, "ignore_eos": True, "stream": True,
          "stream_options": {"include_usage": True}}  # fmt: skip


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and (param is None or error["param"] == param), error
    return error


def rss_mb(pid: int) -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


async def _stream_tokens(client: httpx.AsyncClient, started: asyncio.Event) -> tuple[int, str | None]:
    tokens, finish = 0, None
    async with client.stream("POST", CMPL, json=STREAM) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            started.set()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                finish = choice["finish_reason"] or finish
    return tokens, finish


HOSTILE = [
    # Finding 1: top_k past int64 overflowed the sampler's tensor build and failed the whole step (8 of 8 streams).
    ({"top_k": 9223372036854775808}, "top_k"),
    ({"top_k": 2**64}, "top_k"),  # past uint64: msgspec could not even encode it (a 500)
    ({"top_k": 1e30}, "top_k"),
    ({"logit_bias": {"0": 1e9}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"stop": ["x" * 100_000]}, "stop"),
]


def test_hostile_requests_fail_alone_beside_8_streams(server: Server):
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            started = asyncio.Event()
            streams = [asyncio.create_task(_stream_tokens(client, started)) for _ in range(8)]
            await asyncio.wait_for(started.wait(), 60)
            for extra, param in HOSTILE:
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0.8, **extra}
                assert_openai_error(await client.post(CMPL, json=body), 400, param)
            for tokens, finish in await asyncio.gather(*streams):
                assert (tokens, finish) == (24, "length")

    asyncio.run(scenario())
    assert_engine_idle_within(server, 10)


NON_FINITE = [b'{"prompt": "x", "temperature": Infinity}', b'{"prompt": "x", "temperature": NaN}',
              b'{"prompt": "x", "repetition_penalty": Infinity}', b'{"prompt": "x", "top_p": NaN}',
              b'{"prompt": "x", "logit_bias": "strong"}', b'{"prompt": "x", "logit_bias": {"a": 1}}']  # fmt: skip


@pytest.mark.parametrize("body", NON_FINITE, ids=[b.decode()[15:] for b in NON_FINITE])
def test_non_finite_and_malformed_sampling_values_are_refused(server: Server, body: bytes):
    """Finding 7: these used to get a 200 and were silently ignored (or made the logits inf)."""
    r = httpx.post(server.url + CMPL, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert_openai_error(r, 400)


def test_logit_bias_steers_greedy_decoding(server: Server):
    """Finding 7: logit_bias is applied, not ignored: +100 on a token makes greedy pick it every time."""
    token = httpx.post(server.url + "/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()
    forced = token["tokens"][0]
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
            "logit_bias": {str(forced): 100}}  # fmt: skip
    r = httpx.post(server.url + CMPL, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " banana" * 3
    plain = httpx.post(server.url + CMPL, json={**body, "logit_bias": None}, timeout=60).json()
    assert "banana" not in plain["choices"][0]["text"]


SURROGATE = b'"a\\ud800b"'
SURROGATE_BODIES = [
    (CMPL, b'{"prompt": %s}' % SURROGATE, "prompt"),
    (CMPL, b'{"prompt": ["ok", %s]}' % SURROGATE, "prompt"),
    (CMPL, b'{"prompt": "x", "stop": [%s]}' % SURROGATE, "stop"),
    (CMPL, b'{"prompt": "x", "model": "\\ud800"}', "model"),
    (CHAT, b'{"messages": [{"role": "user", "content": %s}]}' % SURROGATE, "messages"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}' % SURROGATE, "messages"),
    ("/tokenize", b'{"prompt": %s}' % SURROGATE, "prompt"),
    ("/generate", b'{"prompt": %s}' % SURROGATE, "prompt"),
]


def test_lone_surrogates_are_a_400_and_keep_the_connection(server: Server):
    """Finding 3: lone surrogates gave a 500 from the tokenizer (or from building the 404 message), and the
    keep-alive connection was closed under the client."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for path, body, param in SURROGATE_BODIES:
            r = client.post(path, content=body, headers={"content-type": "application/json"})
            assert_openai_error(r, 400, param)
            assert r.headers.get("connection") != "close"
        assert client.post(CMPL, json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_completions_max_tokens_null_means_16(server: Server):
    """Finding 8: null generated to the end of the context; OpenAI's and vLLM's completions default is 16."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": None, "ignore_eos": True}
    r = httpx.post(server.url + CMPL, json=body, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text


class HealthProbe:
    """Polls /health every 20 ms in a thread and keeps the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.failures = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                self.failures += client.get(self.url + "/health").status_code != 200
                self.worst = max(self.worst, time.monotonic() - start)
                time.sleep(0.02)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()


def _status_after_headers(server: Server, length: int, first: bytes) -> tuple[bytes, float]:
    """Sends a POST's headers and the first body bytes; returns the status line and how long it took to come."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        head = (f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {length}\r\n\r\n").encode()  # fmt: skip
        start = time.monotonic()
        sock.sendall(head + first)
        status = sock.recv(4096).split(b"\r\n", 1)[0]
        return status, time.monotonic() - start


def test_20mb_body_is_refused_before_parsing(server: Server):
    """Finding 4: a 20 MB body was parsed and tokenized on the event loop: 400 after 29.8 s, /health blocked,
    the API process grown by 2.5 GB. Now: 413 before a byte of it is read, and nothing else notices."""
    api_pid = server.proc.pid
    before = rss_mb(api_pid)
    big = b'{"prompt": "' + b"hello world " * (20_000_000 // 12) + b'"}'
    with HealthProbe(server.url) as probe:
        status, took = _status_after_headers(server, len(big), big[:65536])
        assert status.startswith(b"HTTP/1.1 413") and took < 0.1, (status, took)
        start = time.monotonic()  # the whole body sent by a real client: the 413 still comes, the rest is drained
        r = httpx.post(server.url + CMPL, content=big, headers={"content-type": "application/json"}, timeout=60)
        assert_openai_error(r, 413)
        assert time.monotonic() - start < 5
        # Without a Content-Length (chunked), the limit holds while reading.
        chunks = (big[i : i + 1 << 20] for i in range(0, len(big), 1 << 20))
        assert_openai_error(httpx.post(server.url + CMPL, content=chunks, timeout=60), 413)
    assert probe.failures == 0 and probe.worst < 0.1, probe.worst
    assert rss_mb(api_pid) - before < 50


def test_large_prompt_is_tokenized_off_the_event_loop(server: Server):
    """Finding 4: a prompt within the body limit but far beyond the context is tokenized in a worker thread:
    /health and the other streams never wait for it, and its answer is a 400."""
    prompt = "hello world, this is some text. " * 100_000  # 3.2 MB, about 800k tokens
    with HealthProbe(server.url) as probe:
        r = httpx.post(server.url + CMPL, json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=120)
        assert_openai_error(r, 400, "max_tokens")
    assert probe.failures == 0 and probe.worst < 0.25, probe.worst
