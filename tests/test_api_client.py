"""AsyncEngineClient as the asyncio direct client (no HTTP): streams, merged deltas, aborts, hung-engine detection
(and a long step that still moves, which is no hang)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from common.config import EngineConfig
from common.messages import EngineRequest, SamplingParams
from common.model_source import resolve_model
from frontend.engine.engine_client import AsyncEngineClient
from frontend.text.detokenizer import IncrementalDetokenizer
from frontend.text.tokenizer import Tokenizer
from tests.conftest import TEST_DP

STORY = "Once upon a time, there was a dragon who"


@pytest.fixture(scope="module")
def env():
    """One event loop for the module: the client's sockets and tasks belong to it."""
    runner = asyncio.Runner()
    config = EngineConfig(dtype="float32", num_kv_blocks=256, max_model_len=1024)
    client = runner.run(AsyncEngineClient.spawn(config, ping_timeout=30.0, data_parallel_size=TEST_DP))
    yield runner, client, Tokenizer(resolve_model(None).path)
    runner.run(client.close())
    runner.close()
    assert client.supervisor is not None and client.supervisor.exit_code() is not None


def request(tok: Tokenizer, rid: str, max_tokens: int, **kw) -> EngineRequest:
    return EngineRequest(rid, tok.encode(STORY), SamplingParams(max_tokens=max_tokens, temperature=0, **kw))


async def running(client: AsyncEngineClient) -> int:
    """Requests in the engines (every data-parallel one)."""
    total = 0
    for engine in range(len(client.handles)):
        stats = (await client.call("stats", timeout=10, engine=engine)).stats
        assert stats is not None
        total += stats.num_running + stats.num_waiting
    return total


def test_lagging_consumer_gets_merged_deltas(env):
    runner, client, tok = env

    async def scenario():
        req = request(tok, "lag", 8, ignore_eos=True)
        stream = client.add(req, IncrementalDetokenizer(tok, req.prompt_token_ids))
        first = await stream.get()
        while not stream.finished:  # a consumer that lags: the engine's outputs pile up in the one slot
            await asyncio.sleep(0.05)
        rest = await stream.get()
        with pytest.raises(StopAsyncIteration):
            await stream.get()
        assert len(first.token_ids + rest.token_ids) == 8 and len(rest.token_ids) > 1  # one merged delta
        assert first.finish_reason is None and rest.finish_reason == "length"
        assert first.text + rest.text == tok.decode(first.token_ids + rest.token_ids)
        assert client.num_in_flight == 0

    runner.run(scenario())


def test_stop_string_and_early_exit_abort_in_the_engine(env):
    runner, client, tok = env

    async def scenario():
        req = request(tok, "stop", 500, ignore_eos=True)
        detok = IncrementalDetokenizer(tok, req.prompt_token_ids, stop=["magic"])
        deltas = [d async for d in client.generate(req, detok)]
        assert "".join(d.text for d in deltas) == " was a master of " and deltas[-1].stop_reason == "magic"
        assert await running(client) == 0  # the frontend's abort reached the engine before this call
        async with contextlib.aclosing(client.generate(request(tok, "leave", 500, ignore_eos=True))) as gen:
            async for _ in gen:
                break  # a consumer that leaves early aborts its request
        assert await running(client) == 0

    runner.run(scenario())


def test_a_long_step_that_moves_is_not_a_hang(env):
    """A step past the ping timeout that still ticks (engine_core/pulse.py) keeps its engine and its requests: a
    2048-token chunk at the end of an 8k context took 32 s on a 2-core CPU, where the ping timeout is 30 s, and its
    engine was killed as hung after every restart."""
    runner, client, tok = env

    async def scenario():
        client.ping_timeout = 1.5
        try:
            stream = client.add(request(tok, "long-step", 24, ignore_eos=True))
            engine = client.engine_of(stream)
            assert engine is not None
            delta, restarts = await stream.get(), engine.restarts
            result = await client.call("busy", 5.0, timeout=20, engine=engine.index)  # three ping timeouts
            assert result.ok and engine.healthy and engine.restarts == restarts
            while delta.finish_reason is None:
                delta = await stream.get()
            assert delta.finish_reason == "length" and delta.error is None
        finally:
            client.ping_timeout = 30.0

    runner.run(scenario())


def test_hung_engine_fails_in_flight_requests(env):
    runner, client, tok = env

    async def scenario():
        client.ping_timeout = 1.5
        stream = client.add(request(tok, "hung", 500, ignore_eos=True))
        engine = client.engine_of(stream)  # the one it was routed to
        assert engine is not None
        delta = await stream.get()
        sleeper = asyncio.ensure_future(client.call("sleep", 8.0, timeout=20, engine=engine.index))  # it hangs
        start = time.monotonic()
        while delta.finish_reason is None:
            delta = await stream.get()
        assert delta.finish_reason == "error" and "health check" in (delta.error or "")
        assert time.monotonic() - start < 4 and not engine.healthy
        with pytest.raises(Exception, match="health check"):
            await sleeper

    runner.run(scenario())
