"""Data parallel (--data-parallel-size 2, one server for the module): the OpenAI suite's key checks, prefix affinity,
kill -9 of one engine under 32 streams while the other serves on, /health and /metrics per engine; the router's
and the placement's rules without a server.

The whole API suite runs against two engines with `ROSEINFER_TEST_DP=2 pytest tests/test_api.py
tests/test_api_client.py tests/test_api_streaming.py`; here, its checks that need only a server run against
this module's DP=2 `server` (the imported tests take the module's fixture)."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import httpx
import pytest

from common.config import EngineConfig
from frontend.engine.placement import place_engines
from frontend.engine.router import PrefixRouter
from tests.conftest import SPARE, Server, engine_children, engine_index_of, spare_children
from tests.test_api import (  # noqa: F401  (fixtures and tests, run here against two engines)
    base,
    client,
    test_chat_streaming_order_and_usage,
    test_completion_logprobs_and_echo,
    test_generate_models_metrics_and_request_id,
    test_n_choices,
    test_seeded_sampling_is_reproducible,
    test_stop_string_split_across_tokens,
    test_streaming_equals_non_streaming,
)
from tests.test_api_crash import Run, stream, wait_progress
from tests.test_api_streaming import (  # noqa: F401
    test_64_concurrent_streams,
    test_non_streaming_client_disconnect_aborts_in_engine,
    test_streaming_client_disconnect_aborts_in_engine,
)

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    dp = Server(tmp_path_factory.mktemp("dp2"), SPARE, "--data-parallel-size", "2", "--max-engine-restarts", "4",
                "--engine-ping-timeout", "60")  # fmt: skip
    yield dp.wait_healthy()
    dp.engine_pids = engine_children(dp)  # after a restart: the current ones
    dp.assert_clean_exit()


def per_engine(server: Server, name: str) -> dict[int, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found = re.findall(rf'^roseinfer:{name}{{engine="(\d+)",model_name="{MODEL}"}} (\S+)$', text, re.M)
    return {int(e): float(v) for e, v in found}


def health(server: Server) -> tuple[int, dict]:
    r = httpx.get(server.url + "/health", timeout=10)
    return r.status_code, r.json()


def test_health_and_metrics_show_both_engines(server: Server):
    status, body = health(server)
    assert status == 200 and body["status"] == "ok", body
    assert [(e["index"], e["state"]) for e in body["engines"]] == [(0, "ready"), (1, "ready")]
    assert sorted(e["pid"] for e in body["engines"]) == sorted(engine_children(server))
    for name in ("num_requests_running", "kv_cache_blocks_in_use", "prefix_cache_hits_total", "engine_restarts_total"):
        assert set(per_engine(server, name)) == {0, 1}, name
    # Each engine on its own core (this machine has at least 2) and one thread each.
    pids = {engine_index_of(p): p for p in engine_children(server)}
    cpus = [os.sched_getaffinity(pids[i]) for i in (0, 1)]
    if len(os.sched_getaffinity(0)) >= 2:
        assert cpus[0] and cpus[1] and not cpus[0] & cpus[1], cpus


def _completion(server: Server, prompt: str, max_tokens: int = 2) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _engine_that_looked_up(before: dict[int, float], after: dict[int, float]) -> int:
    """The one engine whose prefix cache was asked about a prompt between the two snapshots."""
    grew = [e for e in after if after[e] > before.get(e, 0.0)]
    assert len(grew) == 1, (before, after)
    return grew[0]


def test_shared_prefix_lands_on_the_engine_that_holds_it(server: Server):
    prefix = "Here are the rules of the house, read them carefully. " * 26  # about 300 tokens: 18 full blocks
    busy = {"model": MODEL, "prompt": "Count from one to a thousand:", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    # Engine 0 is busy: the first request goes to engine 1, the least loaded.
    with httpx.stream("POST", server.url + "/v1/completions", json=busy, timeout=120) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        queries = per_engine(server, "prefix_cache_queries_total")
        _completion(server, prefix + "First question: who cooks?")
        first = _engine_that_looked_up(queries, per_engine(server, "prefix_cache_queries_total"))
    # Now both are idle (the busy stream was closed): a tie that load alone would give to engine 0.
    hits = per_engine(server, "prefix_cache_hits_total")
    queries = per_engine(server, "prefix_cache_queries_total")
    _completion(server, prefix + "Second question: who cleans?")
    second = _engine_that_looked_up(queries, per_engine(server, "prefix_cache_queries_total"))
    assert first == second == 1
    assert per_engine(server, "prefix_cache_hits_total")[1] - hits[1] >= 256  # the shared blocks were reused


def _body(i: int) -> dict:
    return {"model": MODEL, "prompt": f"Story number {i}: once upon a time in a town called {i * 7 % 31},",
            "max_tokens": 40, "temperature": 0, "ignore_eos": True}  # fmt: skip


def test_kill_one_engine_under_32_streams(server: Server):
    bodies = [_body(i) for i in range(32)]

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            reference = await asyncio.gather(*(stream(http, b) for b in bodies))
            restarts = per_engine(server, "engine_restarts_total")
            runs = [Run() for _ in bodies]
            tasks = [asyncio.create_task(stream(http, b, r)) for b, r in zip(bodies, runs, strict=True)]
            await wait_progress(runs, 3)
            engines = (await http.get("/health")).json()["engines"]
            assert all(e["in_flight"] > 0 for e in engines), engines  # both engines carry streams
            victim = next(p for p in engine_children(server) if engine_index_of(p) == 1)
            # Without its spare, engine 1 restarts cold: long enough to watch engine 0 serve alone meanwhile.
            os.kill(next(p for p in spare_children(server) if engine_index_of(p) == 1), signal.SIGKILL)
            os.kill(victim, signal.SIGKILL)
            for _ in range(200):  # the socket monitor notices at once
                body = (await http.get("/health")).json()
                if body["engines"][1]["state"] == "restarting":
                    break
                await asyncio.sleep(0.02)
            assert body["status"] == "degraded" and body["engines"][0]["state"] == "ready", body
            # While engine 1 restarts, engine 0 takes and completes new requests (and /health stays 200).
            extra = await asyncio.gather(*(http.post("/v1/completions", json={**_body(100 + i), "max_tokens": 4})
                                           for i in range(4)))  # fmt: skip
            assert [r.status_code for r in extra] == [200] * 4
            status, during = health(server)
            assert status == 200 and during["engines"][1]["state"] != "ready", during  # it was still restarting
            done = await asyncio.gather(*tasks)
            for run, ref in zip(done, reference, strict=True):
                assert run.status == 200 and run.done and run.error is None, run
                assert run.usage == ref.usage and run.text == ref.text
            after = per_engine(server, "engine_restarts_total")
            assert after[1] == restarts[1] + 1 and after[0] == restarts[0]

    asyncio.run(scenario())
    status, body = health(server)
    assert status == 200 and [e["state"] for e in body["engines"]] == ["ready", "ready"], body
    assert body["engines"][1]["restarts"] == body["engines"][0]["restarts"] + 1, body
    assert "engine core 1 (epoch 0) disconnected" in server.log.read_text()
    # Each engine has its spare again, on the engine's own cores.
    engines = {engine_index_of(p): p for p in engine_children(server)}
    spares = {engine_index_of(p): p for p in spare_children(server)}
    assert sorted(spares) == sorted(engines) == [0, 1]
    assert all(os.sched_getaffinity(spares[i]) == os.sched_getaffinity(engines[i]) for i in engines)


class _Engine:
    def __init__(self, index: int, load: int = 0) -> None:
        self.index = index
        self.load = load


def test_router_prefers_the_prefix_holder_unless_far_more_loaded():
    router = PrefixRouter(block_size=4)
    e0, e1 = _Engine(0), _Engine(1, load=10)
    shared = list(range(40))
    assert router.choose(shared + [100], [e0, e1]) is e0  # least loaded; remembered
    e0.load, e1.load = 20, 0
    assert router.choose(shared + [101], [e0, e1]) is e0  # 40 cached tokens outweigh 20 of load
    e0.load = 60
    assert router.choose(shared + [102], [e0, e1]) is e1  # now recomputing the prefix on e1 is cheaper
    e0.load = e1.load = 0
    assert router.choose([7, 8, 9, 10, 11], [e0, e1]) is e0  # nothing cached: a tie goes to the lower index
    router.forget(0)  # engine 0 restarted: its cache is empty
    e1.load = 1
    assert router.choose(shared + [103], [e0, e1]) is e1  # e1 was sent the prefix at the third choice
    assert router.choose([1, 2], [e1]) is e1  # the only live engine


def test_router_keeps_lora_adapters_apart():
    """An engine holds a prompt's K/V under the adapter that computed it (the prefix cache keys blocks by adapter)."""
    router = PrefixRouter(block_size=4)
    e0, e1 = _Engine(0), _Engine(1, load=10)
    shared = list(range(40))
    assert router.choose(shared + [100], [e0, e1]) is e0
    e0.load, e1.load = 20, 0
    assert router.choose(shared + [101], [e0, e1], scope=(1, "")) is e1  # no block of it under sql on e0
    e1.load = 30
    assert router.choose(shared + [102], [e0, e1], scope=(1, "")) is e1  # now cached on e1 under sql
    assert router.choose(shared + [103], [e0, e1]) is e0  # and the base model's on e0


def test_router_table_is_bounded():
    router = PrefixRouter(block_size=2, max_entries=8)
    for i in range(100):
        router.choose([i, i, i, i, i], [_Engine(0)])
    assert len(router._engines) == 8


def test_placement_splits_cores_and_gpus(monkeypatch: pytest.MonkeyPatch):
    single = place_engines(EngineConfig(), 1)
    assert single[0].config == EngineConfig() and single[0].cpus is None  # one engine: as before
    two = place_engines(EngineConfig(), 2, cores=[0, 1, 2, 3, 4])
    assert [p.cpus for p in two] == [frozenset({0, 1}), frozenset({2, 3})]
    assert [(p.config.engine_index, p.config.num_threads) for p in two] == [(0, 2), (1, 2)]
    crowded = place_engines(EngineConfig(), 3, cores=[0, 1])  # fewer cores than engines: shared, 1 thread each
    assert [p.cpus for p in crowded] == [None] * 3 and {p.config.num_threads for p in crowded} == {1}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    gpus = place_engines(EngineConfig(device="auto"), 2, cores=[0, 1])
    assert [p.env for p in gpus] == [{"CUDA_VISIBLE_DEVICES": "4"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    assert all(p.env == {} for p in place_engines(EngineConfig(device="cpu"), 2, cores=[0, 1]))
