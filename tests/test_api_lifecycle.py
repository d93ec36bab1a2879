"""Process lifecycle: API key, CORS, queue limit, engine kill -9 under load, a reused X-Request-Id, SIGTERM drain,
start-up failures."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import REPO, Server, free_port

MODEL = "SmolLM2-135M-Instruct"
KEY = {"Authorization": "Bearer sk-test"}
ORIGIN = "http://good.example"
# Long enough to outlast each test's steps on a GPU too (an H100 ran 1000 tokens before the drain's 5 s were up):
# both servers take the model's whole 8192-token context.
LONG = {"model": MODEL, "prompt": "Tell me about whales.", "max_tokens": 8000, "ignore_eos": True}
CONTEXT = ("--max-model-len", "8192")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """Two servers loading side by side: `guarded` (key, CORS, queue of 6, no engine restarts: the fail-fast path)
    and `draining` (5 s drain)."""
    guarded = Server(tmp_path_factory.mktemp("guarded"), "--api-key", "sk-test", "--allowed-origins", ORIGIN,
                     "--allowed-methods", "GET", "POST", "--allowed-headers", "authorization", "content-type",
                     "--allow-credentials", "--max-queued-requests", "6", "--max-engine-restarts", "0",
                     *CONTEXT)  # fmt: skip
    draining = Server(tmp_path_factory.mktemp("draining"), "--drain-timeout", "5", *CONTEXT)
    yield guarded.wait_healthy(), draining.wait_healthy()
    for s in (guarded, draining):
        if s.proc.poll() is None:
            s.stop()


GUARDED = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
           ("POST", "/generate", {"prompt": "x", "max_tokens": 1}), ("POST", "/tokenize", {"prompt": "x"}),
           ("POST", "/detokenize", {"tokens": [1]}), ("GET", "/docs", None), ("GET", "/openapi.json", None),
           ("GET", "/redoc", None), ("GET", "/version", None), ("GET", "/no/such/route", None),
           ("POST", "/v1/messages", {"model": "SmolLM2-135M-Instruct", "max_tokens": 1,
                                     "messages": [{"role": "user", "content": "x"}]})]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "body"), GUARDED, ids=[g[1] for g in GUARDED])
def test_api_key_guards_every_route_but_health_and_metrics(servers, method, path, body):
    """The key used to cover /v1/* only: /generate, /tokenize, /detokenize and the API docs answered anyone."""
    url = servers[0].url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"x-api-key": ""}):
        r = httpx.request(method, url + path, headers=headers, json=body)
        error = r.json()["error"]  # Anthropic's shape on its Messages API
        anthropic = path == "/v1/messages"
        refused = error["type"] == "authentication_error" if anthropic else error["code"] == "invalid_api_key"
        assert r.status_code == 401 and refused, (path, r.text)
    # With the key, as a bearer token or as Anthropic's clients send it: served, except the docs, which are off
    # unless --enable-docs.
    docs = path in ("/docs", "/openapi.json", "/redoc", "/no/such/route")
    for key in (KEY, {"x-api-key": KEY["Authorization"].removeprefix("Bearer ")}):
        r = httpx.request(method, url + path, headers=key, json=body, timeout=60)
        assert r.status_code == (404 if docs else 200), r.text
    assert all(httpx.request(m, url + p).status_code == 200
               for m, p in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/metrics")))  # fmt: skip


def test_cors_allows_only_the_configured_origin(servers):
    url = servers[0].url + "/v1/completions"
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = httpx.options(url, headers={"Origin": ORIGIN, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert ok.headers["access-control-allow-credentials"] == "true"  # --allow-credentials
    assert ok.headers["access-control-allow-methods"] == "GET, POST"  # --allowed-methods
    other = httpx.options(url, headers={"Origin": "http://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    for refused in ({"Access-Control-Request-Method": "DELETE"}, {**preflight, "Access-Control-Request-Headers": "x"}):
        assert httpx.options(url, headers={"Origin": ORIGIN, **refused}).status_code == 400  # not allowed


async def _stream(client: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None,
                  times: list[float] | None = None) -> tuple[int, list[str]]:  # fmt: skip
    """All `data:` events of a streamed completion; `started` is set at the first, `times` gets each one's time."""
    events = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if started is not None:
                    started.set()
                if times is not None:
                    times.append(time.monotonic())
        return r.status_code, events


async def _wait_running(client: httpx.AsyncClient, count: int) -> None:
    for _ in range(600):
        text = (await client.get("/metrics")).text
        if f'roseinfer:num_requests_running{{engine="0",model_name="{MODEL}"}} {float(count)}' in text:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never saw {count} running requests")


def test_queue_limit_then_engine_killed_under_load(servers):
    server = servers[0]

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=KEY, timeout=60) as client:
            streams = [asyncio.create_task(_stream(client, LONG)) for _ in range(4)]
            plain = [asyncio.create_task(client.post("/v1/completions", json=LONG)) for _ in range(2)]
            await _wait_running(client, 6)
            start = time.monotonic()
            full = await client.post("/v1/completions", json={**LONG, "max_tokens": 1})
            assert full.status_code == 429 and time.monotonic() - start < 1.0
            assert "max-queued-requests" in full.json()["error"]["message"] and full.headers["retry-after"] == "1"
            # A burst while full is refused before any template or tokenizer work: each answer comes at once.
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "whales " * 5_000}], "max_tokens": 1}
            start = time.monotonic()
            burst = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat) for _ in range(64)))
            assert {r.status_code for r in burst} == {429} and time.monotonic() - start < 2.0

            assert server.engine_pid is not None
            os.kill(server.engine_pid, signal.SIGKILL)
            start = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*streams, *plain), timeout=5)
            assert time.monotonic() - start < 5
            for status, events in results[:4]:  # streams end with an error event, then [DONE]
                assert status == 200 and events[-1] == "[DONE]" and '"error"' in events[-2], events[-2:]
            for r in results[4:]:
                assert r.status_code == 503 and "engine core" in r.json()["error"]["message"]
            assert (await client.get("/health")).status_code == 503
            after = await client.post("/v1/completions", json={**LONG, "max_tokens": 1})
            assert after.status_code == 503 and "engine core" in after.json()["error"]["message"]

    asyncio.run(scenario())
    server.assert_clean_exit()  # SIGTERM still exits 0, and leaves no process or ipc file behind


def test_requests_sharing_an_x_request_id_each_run_on_their_own(servers):
    """A gateway retries (Envoy) or hedges with the X-Request-Id of a try the engine may still be running."""
    server = servers[1]

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, headers={"X-Request-Id": "retry-1"}) as client:
            async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as first:
                async for line in first.aiter_lines():
                    if line.startswith("data: "):
                        break  # the first try's client gives up mid-stream: aborted in the engine
            body = {**LONG, "max_tokens": 8}
            retries = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(2)))
            for r in retries:  # both at once, each with exactly its own 8 tokens
                assert r.status_code == 200 and r.headers["x-request-id"] == "retry-1", r.text
                choice = r.json()["choices"][0]
                assert r.json()["id"] == "cmpl-retry-1" and choice["finish_reason"] == "length"
                assert r.json()["usage"]["completion_tokens"] == 8

    asyncio.run(scenario())


def test_sigterm_drains_in_flight_requests(servers):
    server = servers[1]

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            long_started, short_started, short_times = asyncio.Event(), asyncio.Event(), []
            long = asyncio.create_task(_stream(client, LONG, long_started))
            await long_started.wait()
            short = asyncio.create_task(_stream(client, {**LONG, "max_tokens": 8}, short_started, short_times))
            await short_started.wait()
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            (_, s_events), (_, l_events) = await asyncio.wait_for(asyncio.gather(short, long), 30)
            assert s_events[-1] == "[DONE]" and '"finish_reason":"length"' in s_events[-2]  # finished normally
            assert short_times[-1] > signalled  # ... while the server was already stopping
            assert l_events[-1] == "[DONE]" and "shutting down" in l_events[-2]  # ended after --drain-timeout
            with pytest.raises(httpx.TransportError):  # no new connections
                await client.get("/health")

    asyncio.run(scenario())
    server.assert_clean_exit()


def _launch(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)}
    return subprocess.run([sys.executable, "launch.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_engine_start_failure_exits_with_the_engine_error(tmp_path):
    # A KV cache too small for one request passes the command line and fails in the engine, as it loads.
    r = _launch(tmp_path, "--num-kv-blocks", "4", "--port", str(free_port()))
    assert r.returncode != 0
    assert "error: engine core failed to start" in r.stderr and "--num-kv-blocks 4 cannot hold" in r.stderr
    assert not any(p.name.startswith("roseinfer-") for p in tmp_path.iterdir())


def test_taken_port_fails_fast(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        start = time.monotonic()
        r = _launch(tmp_path, "--port", str(taken.getsockname()[1]))
    assert r.returncode == 1 and "cannot listen" in r.stderr and time.monotonic() - start < 10
    assert not any(p.name.startswith("roseinfer-") for p in tmp_path.iterdir())
