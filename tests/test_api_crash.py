"""Surviving an engine crash over HTTP: kill -9 and a hang mid-decode resume exactly; poison requests; the budget."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import SPARE, Server, engine_child
from tests.test_api_streaming import metric

MODEL = "SmolLM2-135M-Instruct"
POISON_TOKEN = 12345  # ROSEINFER_DEBUG_CRASH_ON_TOKEN: the engine process exits on a prompt holding it
PING_TIMEOUT = 10.0  # above what a step spends between attention layers (engine_core/pulse.py) on a busy machine
MAX_TOKENS = 32
TOPICS = ["whales", "volcanoes", "the moon", "bread", "trains", "owls", "glaciers", "chess", "honey", "lighthouses",
          "comets", "tea", "bicycles", "coral reefs", "clocks", "maps"]  # fmt: skip


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """`crashy` (10 restarts, 10 s ping timeout), `fragile` (1 restart, new requests wait 0.5 s for an engine; no
    spare, so that a restart outlasts that wait) and `serial` (one request at a time, so that the others queue in the
    engine). crashy decodes overlapped (engine_core/overlap.py, CUDA's default), so crash resume is checked on that
    path too; the other test servers take the synchronous one, the CPU's default."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ROSEINFER_DEBUG_CRASH_ON_TOKEN", str(POISON_TOKEN))  # inherited by each engine core
        env.setenv("ROSEINFER_SPARE_WARM_UP_AFTER", "0")  # restarts here come faster than the spares' usual wait
        crashy = Server(tmp_path_factory.mktemp("crashy"), SPARE, "--max-engine-restarts", "10",
                        "--engine-ping-timeout", str(PING_TIMEOUT), "--max-num-batched-tokens", "512",
                        "--overlap-decode", "on")  # fmt: skip
        fragile = Server(tmp_path_factory.mktemp("fragile"), "--max-engine-restarts", "1",
                         "--engine-restart-timeout", "0.5", "--num-kv-blocks", "128")  # fmt: skip
        serial = Server(tmp_path_factory.mktemp("serial"), SPARE, "--max-num-seqs", "1", "--num-kv-blocks", "128")
    yield crashy.wait_healthy(), fragile.wait_healthy(), serial.wait_healthy()
    serial.stop()
    if fragile.proc.poll() is None:
        fragile.stop()
    crashy.engine_pid = engine_child(crashy)
    crashy.assert_clean_exit()  # after five restarts: exit 0, no engine core, no ipc files


def body(i: int, max_tokens: int = MAX_TOKENS) -> dict:
    """Even i greedy, odd i seeded sampling: both must resume exactly."""
    sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i}
    prompt = f"Write a short story about {TOPICS[i]}."
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **sampling}


@dataclass
class Run:
    """What one streamed completion delivered."""

    status: int = 0
    text: str = ""
    chunks: int = 0  # content events so far: progress
    usage: dict | None = None
    error: dict | None = None
    done: bool = False


async def stream(client: httpx.AsyncClient, payload: dict, run: Run | None = None) -> Run:
    run = run or Run()
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        run.status = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                run.done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                run.error = event["error"]
                continue
            run.usage = event.get("usage") or run.usage
            for choice in event["choices"]:
                run.text += choice["text"]
                run.chunks += bool(choice["text"])
    return run


async def wait_health(client: httpx.AsyncClient, status: int, timeout: float) -> float:
    """Seconds until /health answers `status`."""
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < timeout:
        if (await client.get("/health")).status_code == status:
            return elapsed
        await asyncio.sleep(0.02)
    raise AssertionError(f"/health never answered {status} within {timeout} s")


async def wait_progress(runs: list[Run], more: int, timeout: float = 120.0) -> None:
    """Until every stream delivered `more` content events beyond what it had."""
    targets = [r.chunks + more for r in runs]
    deadline = time.monotonic() + timeout
    while any(r.chunks < t for r, t in zip(runs, targets, strict=True)):
        assert time.monotonic() < deadline, [r.chunks for r in runs]
        assert not any(r.done for r in runs), "a stream ended before the engine was disturbed"
        await asyncio.sleep(0.02)


async def signal_mid_stream(server: Server, runs: list[Run], sig: signal.Signals) -> int:
    """Once every stream delivered 3 more content events, sends `sig` to the engine core; returns its pid."""
    await wait_progress(runs, 3)
    pid = engine_child(server)
    assert pid is not None
    os.kill(pid, sig)
    return pid


async def reference_then_start(client: httpx.AsyncClient, bodies: list[dict]):
    """Runs the bodies undisturbed for a reference, then starts them again as tasks to be disturbed."""
    reference = await asyncio.gather(*(stream(client, b) for b in bodies))
    before = await restarts(client)
    runs = [Run() for _ in bodies]
    tasks = [asyncio.create_task(stream(client, b, r)) for b, r in zip(bodies, runs, strict=True)]
    return reference, before, runs, tasks


async def restarts(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    match = re.search(rf'^roseinfer:engine_restarts_total{{engine="0",model_name="{MODEL}"}} (\S+)$', text, re.M)
    assert match, text
    return float(match.group(1))


def assert_same(runs: list[Run], reference: list[Run]) -> None:
    """Complete, and token for token what the undisturbed run produced (usage counts tokens, text shows order)."""
    for run, ref in zip(runs, reference, strict=True):
        assert run.status == 200 and run.done and run.error is None, run
        assert run.usage is not None and run.usage["completion_tokens"] == MAX_TOKENS
        assert run.usage == ref.usage and run.text == ref.text


def test_streams_resume_exactly_after_two_kills(servers):
    server = servers[0]
    bodies = [body(i) for i in range(16)]

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            reference, before, runs, tasks = await reference_then_start(client, bodies)
            waiting = []
            for _ in range(2):  # mid-decode, and (the second time) after resuming
                pid = await signal_mid_stream(server, runs, signal.SIGKILL)
                assert await wait_health(client, 503, timeout=5) < 2.0  # the socket monitor notices at once
                assert "restarting" in (await client.get("/health")).json()["error"]["message"]
                # A new request in the gap waits for the new engine (--engine-restart-timeout, 60 s here).
                waiting.append(asyncio.create_task(client.post("/v1/completions", json=body(2, max_tokens=4))))
                await wait_health(client, 200, timeout=120)  # 503 until the new engine is ready
                assert engine_child(server) not in (None, pid)
            assert_same(await asyncio.gather(*tasks), reference)
            assert [r.status_code for r in await asyncio.gather(*waiting)] == [200, 200]
            assert await restarts(client) == before + 2

    asyncio.run(scenario())
    log = server.log.read_text()
    assert "disconnected" in log and "resumed 16 unfinished requests" in log


def test_hung_engine_is_replaced(servers):
    server = servers[0]
    bodies = [body(i) for i in range(4)]

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            reference, before, runs, tasks = await reference_then_start(client, bodies)
            pid = await signal_mid_stream(server, runs, signal.SIGSTOP)  # alive and connected, but no longer stepping
            # Detected by the ping: its timeout, plus up to one ping interval (1 s), plus polling slack.
            assert await wait_health(client, 503, timeout=30) < PING_TIMEOUT + 2.5
            await wait_health(client, 200, timeout=120)
            assert not Path(f"/proc/{pid}").exists()  # killed and reaped, not left stopped
            assert_same(await asyncio.gather(*tasks), reference)
            assert await restarts(client) == before + 1

    asyncio.run(scenario())
    assert "did not answer a health check" in server.log.read_text()


async def poison_prompt(client: httpx.AsyncClient) -> list[int]:
    ids = (await client.post("/tokenize", json={"prompt": "Describe this poison."})).json()["tokens"]
    for i in range(len(TOPICS)):  # no ordinary prompt may trip the crash hook
        assert POISON_TOKEN not in (await client.post("/tokenize", json={"prompt": body(i)["prompt"]})).json()["tokens"]
    return [*ids, POISON_TOKEN]


def test_poison_request_fails_alone(servers):
    server = servers[0]
    bodies = [body(i) for i in range(3)]

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            poison = {"model": MODEL, "prompt": await poison_prompt(client), "max_tokens": 8}
            reference, before, runs, tasks = await reference_then_start(client, bodies)
            await wait_progress(runs, 3)
            failed = await stream(client, poison)  # crash, resume, crash again: then it is failed, not resumed
            assert failed.status == 200 and failed.done and failed.text == "", failed
            assert failed.error is not None and failed.error["code"] == "request_crashed_engine", failed
            assert failed.error["type"] == "server_error" and "consecutive engine crashes" in failed.error["message"]
            assert_same(await asyncio.gather(*tasks), reference)  # the others resumed twice and finished intact
            assert await restarts(client) == before + 2
            assert (await client.get("/health")).status_code == 200

    asyncio.run(scenario())


def test_requests_queued_at_two_crashes_are_not_blamed(servers):
    """Behind --max-num-seqs 1, requests the engine never started are bystanders of a poison's two crashes however
    long they queue: they resume, and only the poison fails (EngineStarted tells the API who ran)."""
    server = servers[2]
    bodies = [body(i) for i in range(3)]

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            poison = {"model": MODEL, "prompt": await poison_prompt(client), "max_tokens": 8}
            reference = [await stream(client, b) for b in bodies]
            before = await restarts(client)
            runs = [Run() for _ in bodies]
            first = asyncio.create_task(stream(client, bodies[0], runs[0]))
            await wait_progress(runs[:1], 1)
            # Queued in the engine behind the first: the poison, then two more; the poison starts when the first
            # ends, and again first on the new engine.
            failed = asyncio.create_task(stream(client, poison))
            await asyncio.sleep(0.2)
            rest = [asyncio.create_task(stream(client, b, r)) for b, r in zip(bodies[1:], runs[1:], strict=True)]
            failed_run = await failed
            assert failed_run.error is not None and failed_run.error["code"] == "request_crashed_engine", failed_run
            assert_same([await first, *await asyncio.gather(*rest)], reference)
            assert await restarts(client) == before + 2

    asyncio.run(scenario())


def test_poison_response_stream_ends_with_response_failed(servers):
    """/v1/responses: a failure after the stream started is a response.failed event, and the stream ends."""
    server = servers[0]
    before = metric(server, "engine_restarts_total")
    body = {"model": MODEL, "input": "Describe these strings.", "max_output_tokens": 8, "stream": True}  # " strings"
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=300) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"], events
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "request_crashed_engine", failed
    assert metric(server, "engine_restarts_total") == before + 2
    server.wait_healthy(120)  # the engine is back after its second crash


def test_restart_budget_spent_stops_the_server(servers):
    server: Server = servers[1]

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            poison = {"model": MODEL, "prompt": await poison_prompt(client), "max_tokens": 8}
            run = Run()
            task = asyncio.create_task(stream(client, body(0), run))
            await wait_progress([run], 2)
            # Crash 1, restart 1 of 1, crash 2: the poison fails, the budget is spent, the server stops.
            poisoned = asyncio.create_task(client.post("/v1/completions", json=poison))
            await wait_health(client, 503, timeout=10)
            start = time.monotonic()
            late = await client.post("/v1/completions", json=body(1, max_tokens=4))  # waits 0.5 s, then gives up
            assert late.status_code == 503 and "restarting" in late.json()["error"]["message"], late.text
            assert time.monotonic() - start >= 0.5
            r = await poisoned
            assert r.status_code == 500 and r.json()["error"]["code"] == "request_crashed_engine", r.text
            await task
            assert run.status == 200 and run.done and run.error is not None
            assert run.error["code"] == "engine_unavailable", run.error
            assert "server is stopping" in run.error["message"]

    asyncio.run(scenario())
    assert server.proc.wait(timeout=60) == 1, server.log_text()
    assert "stopping the server" in server.log.read_text()
    assert server.ipc_dirs() == []
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _mentions(p, str(server.tmp))]
    assert leftovers == [], "an engine core outlived launch.py"


def _mentions(proc: Path, text: str) -> bool:
    try:
        return text in (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
