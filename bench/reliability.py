"""Reliability probe: bounded, loopback-only load and abuse scenarios against a roseinfer server.

python -m bench.reliability --url http://127.0.0.1:8000 [--pid API_PID] [--api-key K]
    [--scenarios all | streams,mix,big-body,hostile] [--scale 1.0] [--result-json bench/results/reliability.json]
python -m bench.reliability --launch [--server-args "--log-level warning"] ...
    (starts launch.py on a free port, waits for /health, SIGTERMs it at the end; its pid gives the API RSS)

Scenarios (every loop is bounded in requests and seconds; exit code 1 when any saw an unexpected result):
  streams   512 concurrent streaming chat requests (ignore_eos): each ends with [DONE] and exactly max_tokens tokens
  mix       3,000 seeded random requests, 64 at a time, 12% of the streams closed by us mid-way; then the engine
            must drain to 0 running, 0 waiting and 0 KV blocks in use
  big-body  a 20 MB JSON body while /health is polled every 20 ms: expects an early 413, a responsive /health
            and a flat API RSS
  hostile   8 streams, then an out-of-range top_k in the middle: expects 400 and the 8 streams untouched
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import ipaddress
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

if not __package__:  # run as a file (python bench/x.py), not with -m: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.compare import free_port  # noqa: E402
from bench.serve import machine, served_model  # noqa: E402
from bench.serve_metrics import stats_ms  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = ("streams", "mix", "big-body", "hostile")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

# What the server's design promises for an oversized body; a miss is reported as a failure.
BIG_BODY_STATUS_S = 0.1
HEALTH_MAX_S = 0.1
RSS_GROWTH_MB = 50.0

METRIC_RUNNING = "roseinfer:num_requests_running"
METRIC_WAITING = "roseinfer:num_requests_waiting"
METRIC_BLOCKS = "roseinfer:kv_cache_blocks_in_use"
METRIC_RESTARTS = "roseinfer:engine_restarts_total"

WORDS = ("river", "lamp", "orbit", "violin", "granite", "maple", "comet", "harbor", "pixel", "tundra", "saffron")
STOPS: tuple[list[str] | None, ...] = (None, None, ["\n"], [".", "!"], [" the"], ["and"])


# ---------------------------------------------------------------- pure helpers


def scaled(count: int, scale: float) -> int:
    return max(1, round(count * scale))


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def parse_status_line(line: bytes) -> int | None:
    parts = line.split(None, 2)
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
        return int(parts[1])
    return None


def big_json_body(size: int) -> bytes:
    """A valid {"prompt": "..."} document of exactly `size` bytes (plain words: nothing to escape)."""
    head, tail = b'{"prompt": "', b'"}'
    filler = size - len(head) - len(tail)
    if filler < 0:
        raise ValueError(f"a body of {size} bytes cannot hold the JSON frame")
    unit = b"lorem ipsum dolor sit amet "
    return head + (unit * (filler // len(unit) + 1))[:filler] + tail


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of a local process from /proc (None when unknown: no pid, gone, or not Linux)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass
class Outcome:
    """One request as the client saw it."""

    status: int | None = None  # None: no status line (connection error or timeout before it)
    done: bool = False  # the stream's [DONE] arrived (or, not streamed, a 200 JSON body was read)
    closed_by_us: bool = False  # we dropped a stream before its end, on purpose
    error_event: str = ""  # an {"error": ...} event inside a 200 stream
    exception: str = ""
    completion_tokens: int | None = None  # from usage
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    content_chunks: int = 0
    body: str = ""  # start of a non-200 answer, for the report
    ttft: float | None = None
    e2e: float = 0.0


def read_event(o: Outcome, event: dict[str, Any], elapsed: float) -> None:
    """Folds one SSE `data:` object (chat or completions chunk, usage chunk, error event) into the outcome."""
    if "error" in event:
        o.error_event = json.dumps(event["error"])[:200]
        return
    if usage := event.get("usage"):
        o.completion_tokens = usage.get("completion_tokens")
    for choice in event.get("choices") or []:
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        if text:
            o.content_chunks += 1
            if o.ttft is None:
                o.ttft = elapsed
        if choice.get("finish_reason") is not None:
            o.finish_reasons[int(choice.get("index", 0))] = choice["finish_reason"]


def problem(o: Outcome, stream: bool, n: int = 1, tokens: tuple[int, int] | None = None,
            finishes: frozenset[str] = frozenset({"stop", "length"})) -> str | None:  # fmt: skip
    """What is wrong with a valid request's outcome (None: nothing); the kinds are the report's error keys."""
    if o.exception:
        return f"exception:{o.exception.split(':', 1)[0]}"
    if o.status != 200:
        return f"http_{o.status}"
    if o.closed_by_us:  # we cut it: whatever came before is fine
        return None
    if o.error_event:
        return "error_event"
    if stream and not o.done:
        return "no_done"
    if sorted(o.finish_reasons) != list(range(n)):
        return "missing_finish"
    if any(r not in finishes for r in o.finish_reasons.values()):
        return f"finish_{sorted({str(r) for r in o.finish_reasons.values()} - finishes)[0]}"
    if tokens is not None:
        if o.completion_tokens is None:
            return "no_usage"
        if not tokens[0] <= o.completion_tokens <= tokens[1]:
            return "wrong_token_count"
    return None


def describe(o: Outcome, kind: str) -> str:
    detail = o.exception or o.error_event or o.body
    if kind == "wrong_token_count":
        detail = f"completion_tokens={o.completion_tokens}"
    elif kind.startswith("finish_") or kind == "missing_finish":
        detail = f"finish_reasons={o.finish_reasons}"
    return f"{kind}: {detail}"[:240]


def tally(results: list[tuple[Outcome, str | None] | None]) -> dict[str, Any]:
    """Counts of a scenario's requests: unfinished ones (None) are those its time limit cut off."""
    finished = [r for r in results if r is not None]
    problems = Counter(kind for _, kind in finished if kind)
    statuses = Counter(str(o.status) for o, _ in finished)
    firsts = list(dict.fromkeys(describe(o, kind) for o, kind in finished if kind))
    return {"sent": len(results), "finished": len(finished), "unfinished": len(results) - len(finished),
            "errors": sum(problems.values()), "error_kinds": dict(problems), "statuses": dict(statuses),
            "first_errors": firsts[:5]}  # fmt: skip


@dataclass(frozen=True)
class MixSpec:
    chat: bool
    stream: bool
    n: int
    max_tokens: int
    temperature: float
    seed: int | None
    stop: list[str] | None
    ignore_eos: bool
    close_after: int | None  # content chunks after which we drop the stream
    prompt: str


def mix_plan(count: int, seed: int, close_fraction: float = 0.12) -> list[MixSpec]:
    """The mix scenario's requests: every one valid; a share of the streams is cut by the client."""
    rng = random.Random(seed)
    plan = []
    for i in range(count):
        stream, chat = rng.random() < 0.5, rng.random() < 0.5
        close = stream and rng.random() < close_fraction
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
        plan.append(MixSpec(
            chat=chat, stream=stream, n=rng.randint(1, 3),
            # A stream we cut gets room to still be running when we cut it.
            max_tokens=rng.randint(24, 48) if close else rng.randint(1, 32),
            temperature=rng.choice((0.0, 0.7, 1.0)), seed=rng.randrange(2**31) if rng.random() < 0.5 else None,
            stop=rng.choice(STOPS), ignore_eos=close or rng.random() < 0.3,
            close_after=rng.randint(1, 4) if close else None, prompt=f"Request {i}: tell me about {words}.",
        ))  # fmt: skip
    return plan


def mix_body(spec: MixSpec, model: str) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "n": spec.n, "max_tokens": spec.max_tokens,
                            "temperature": spec.temperature, "stream": spec.stream}  # fmt: skip
    if spec.chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.seed is not None:
        body["seed"] = spec.seed
    if spec.stop is not None:
        body["stop"] = spec.stop
    if spec.ignore_eos:
        body["ignore_eos"] = True
    return (CHAT if spec.chat else COMPLETIONS), body


def chat_stream_body(model: str, content: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


# ---------------------------------------------------------------- requests


async def stream_request(client: httpx.AsyncClient, path: str, body: dict[str, Any], close_after: int | None = None,
                         o: Outcome | None = None) -> Outcome:  # fmt: skip
    """One SSE request; `o` may be the caller's, to watch the stream's progress while it runs."""
    o = o or Outcome()
    start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as resp:
            o.status = resp.status_code
            if resp.status_code != 200:
                o.body = (await resp.aread()).decode(errors="replace")[:200]
                return o
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    o.done = True
                    continue
                read_event(o, json.loads(data), time.perf_counter() - start)
                if close_after is not None and o.content_chunks >= close_after:
                    o.closed_by_us = True  # leaving the block closes the connection: the server sees a disconnect
                    break
    except (httpx.HTTPError, httpx.StreamError, ValueError, TypeError, KeyError, AttributeError) as exc:
        o.exception = f"{type(exc).__name__}: {exc}"[:200]  # JSONDecodeError is a ValueError
    finally:
        o.e2e = time.perf_counter() - start
    return o


async def json_request(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Outcome:
    o = Outcome()
    start = time.perf_counter()
    try:
        resp = await client.post(path, json=body)
        o.status = resp.status_code
        if resp.status_code != 200:
            o.body = resp.text[:200]
        else:
            data = resp.json()
            o.done = True
            o.completion_tokens = (data.get("usage") or {}).get("completion_tokens")
            for choice in data.get("choices") or []:
                o.finish_reasons[int(choice.get("index", 0))] = choice.get("finish_reason")
    except (httpx.HTTPError, httpx.StreamError, ValueError, TypeError, KeyError, AttributeError) as exc:
        o.exception = f"{type(exc).__name__}: {exc}"[:200]
    o.e2e = time.perf_counter() - start
    return o


async def bounded_gather(coros: list[Coroutine[Any, Any, Any]], timeout: float) -> tuple[list[Any], bool]:
    """Runs all; returns their results in order, None for those still running at the timeout (then cancelled)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return [], False
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in tasks:  # a bug in the probe, not a server failure: surface it
        if t not in pending and (exc := t.exception()) is not None:
            raise exc
    return [None if t in pending else t.result() for t in tasks], bool(pending)


async def server_gauges(client: httpx.AsyncClient) -> dict[str, float]:
    resp = await client.get("/metrics", timeout=10.0)
    resp.raise_for_status()
    return parse_metrics(resp.text)


async def wait_idle(client: httpx.AsyncClient, timeout: float) -> dict[str, Any]:
    """Polls /metrics until the engine holds no requests and no KV blocks; the last numbers seen either way."""
    start = time.perf_counter()
    last: dict[str, float] = {}
    while True:
        with contextlib.suppress(httpx.HTTPError):
            last = await server_gauges(client)
        idle = bool(last) and all(last.get(k, -1.0) == 0.0 for k in (METRIC_RUNNING, METRIC_WAITING, METRIC_BLOCKS))
        waited = time.perf_counter() - start
        if idle or waited > timeout:
            return {"idle": idle, "seconds_to_idle": round(waited, 3) if idle else None,
                    "num_running": last.get(METRIC_RUNNING), "num_waiting": last.get(METRIC_WAITING),
                    "num_blocks_in_use": last.get(METRIC_BLOCKS)}  # fmt: skip
        await asyncio.sleep(0.25)


async def restarts(client: httpx.AsyncClient) -> float | None:
    try:
        return (await server_gauges(client)).get(METRIC_RESTARTS)
    except httpx.HTTPError:
        return None


async def health_status(client: httpx.AsyncClient) -> int | None:
    try:
        return (await client.get("/health", timeout=10.0)).status_code
    except httpx.HTTPError:
        return None


# ---------------------------------------------------------------- scenarios


@dataclass
class Probe:
    args: argparse.Namespace
    url: str
    pid: int | None  # the API process (launch.py), for its RSS
    model: str = ""

    def client(self, **kw: Any) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # no client-side queueing
        headers = {"Authorization": f"Bearer {self.args.api_key}"} if self.args.api_key else {}
        timeout = httpx.Timeout(self.args.request_timeout, connect=30.0)
        return httpx.AsyncClient(base_url=self.url, limits=limits, timeout=timeout, headers=headers, **kw)


def rss_delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else round(after - before, 1)


async def scenario_streams(p: Probe, client: httpx.AsyncClient) -> dict[str, Any]:
    count, max_tokens = scaled(p.args.streams, p.args.scale), p.args.stream_tokens
    coros = [stream_request(client, CHAT, chat_stream_body(p.model, f"Say one thing about the number {i}.",
                                                           max_tokens)) for i in range(count)]  # fmt: skip
    start = time.perf_counter()
    outcomes, timed_out = await bounded_gather(coros, p.args.scenario_timeout)
    wall = time.perf_counter() - start
    results = [None if o is None else (o, problem(o, True, 1, (max_tokens, max_tokens), frozenset({"length"})))
               for o in outcomes]  # fmt: skip
    out = {"concurrency": count, "max_tokens": max_tokens, **tally(results), "wall_s": round(wall, 3),
           "ttft_ms": stats_ms([o.ttft for o in outcomes if o is not None and o.ttft is not None]),
           "timed_out": timed_out}  # fmt: skip
    out["failures"] = [f"{out['errors']} of {count} streams went wrong"] if out["errors"] else []
    if timed_out:
        out["failures"].append(f"{out['unfinished']} streams still running after {p.args.scenario_timeout} s")
    return out


async def scenario_mix(p: Probe, client: httpx.AsyncClient) -> dict[str, Any]:
    plan = mix_plan(scaled(p.args.mix, p.args.scale), p.args.seed)
    sem = asyncio.Semaphore(p.args.mix_concurrency)
    restarts_before, rss_before = await restarts(client), rss_mb(p.pid)

    async def one(spec: MixSpec) -> tuple[Outcome, str | None]:
        path, body = mix_body(spec, p.model)
        async with sem:
            if spec.stream:
                o = await stream_request(client, path, body, spec.close_after)
            else:
                o = await json_request(client, path, body)
        # Usage counts every choice's tokens; stop strings and EOS may end a choice early.
        return o, problem(o, spec.stream, spec.n, (0, spec.n * spec.max_tokens))

    start = time.perf_counter()
    results, timed_out = await bounded_gather([one(s) for s in plan], p.args.scenario_timeout)
    wall = time.perf_counter() - start
    drained = await wait_idle(client, p.args.drain_timeout)
    rss_after, restarts_after = rss_mb(p.pid), await restarts(client)
    closed = [r[0].closed_by_us and not r[0].done for r in results if r is not None]
    out = {"requests": len(plan), "concurrency": p.args.mix_concurrency, **tally(results), "wall_s": round(wall, 3),
           "requests_per_s": round(len(plan) / wall, 2), "streams": sum(s.stream for s in plan),
           "planned_closes": sum(s.close_after is not None for s in plan), "closed_mid_stream": sum(closed),
           "after": drained, "api_rss_mb_before": rss_before, "api_rss_mb_after": rss_after,
           "api_rss_growth_mb": rss_delta(rss_before, rss_after),
           "engine_restarts": None if restarts_before is None or restarts_after is None
           else restarts_after - restarts_before, "timed_out": timed_out}  # fmt: skip
    failures = [f"{out['errors']} of {len(plan)} requests went wrong"] if out["errors"] else []
    if timed_out:
        failures.append(f"{out['unfinished']} requests still running after {p.args.scenario_timeout} s")
    if not drained["idle"]:
        failures.append(f"engine not idle {p.args.drain_timeout} s after the mix: {drained}")
    if out["engine_restarts"]:
        failures.append(f"the engine core restarted {out['engine_restarts']:g} times")
    out["failures"] = failures
    return out


async def post_raw(host: str, port: int, path: str, body: bytes, headers: dict[str, str],
                   timeout: float) -> dict[str, Any]:  # fmt: skip
    """POSTs over a raw socket, timing the status line on its own: a server may answer before the body is sent.

    A plain socket, not asyncio streams: a server that answers early and closes makes our next send fail, and an
    asyncio transport would then drop the answer already in the socket's receive queue.
    """
    out: dict[str, Any] = {"status": None, "status_s": None, "bytes_sent_at_status": None, "send_error": None}
    loop = asyncio.get_running_loop()
    family, kind, proto, _, address = (await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
    sock = socket.socket(family, kind, proto)
    sock.setblocking(False)
    head = "".join(f"{k}: {v}\r\n" for k, v in {
        "Host": f"{host}:{port}", "Content-Type": "application/json", "Content-Length": str(len(body)),
        "Connection": "close", **headers}.items())  # fmt: skip
    sent = 0
    received = b""

    async def send() -> None:
        nonlocal sent
        await loop.sock_sendall(sock, f"POST {path} HTTP/1.1\r\n{head}\r\n".encode())
        view = memoryview(body)
        for i in range(0, len(body), 1 << 16):
            await loop.sock_sendall(sock, view[i : i + (1 << 16)])
            sent = min(i + (1 << 16), len(body))

    async def receive(until: bytes, limit: int) -> None:
        nonlocal received
        while until not in received and len(received) < limit:
            data = await loop.sock_recv(sock, 1 << 16)
            if not data:
                return
            received += data

    sender: asyncio.Task[None] | None = None
    start = time.perf_counter()
    try:
        await asyncio.wait_for(loop.sock_connect(sock, address), 10.0)
        start = time.perf_counter()
        sender = asyncio.create_task(send())
        await asyncio.wait_for(receive(b"\r\n", 1 << 16), timeout)
        line = received.split(b"\r\n", 1)[0]
        out["status"] = parse_status_line(line)
        if out["status"] is None:
            out["response"] = f"no status line ({line[:80]!r}): the server closed the connection"
        else:
            out["status_s"] = round(time.perf_counter() - start, 4)
            out["bytes_sent_at_status"] = sent
            with contextlib.suppress(TimeoutError, OSError):  # the rest is for the report only
                await asyncio.wait_for(receive(b"\r\n\r\n{", 1 << 16), 5.0)
            out["response"] = received.split(b"\r\n\r\n", 1)[-1].decode(errors="replace")[:300]
    except (TimeoutError, OSError) as exc:
        # Nothing or a partial status line before an error: the server reset or never answered.
        out["response"] = f"{type(exc).__name__} after {time.perf_counter() - start:.3f} s: {exc}"[:300]
    finally:
        if sender is not None:
            if not sender.done():  # the answer is in: no need to send the rest
                sender.cancel()
            result = (await asyncio.gather(sender, return_exceptions=True))[0]
            if isinstance(result, Exception):  # a reset after an early answer shows here
                out["send_error"] = f"{type(result).__name__}: {result}"[:200]
        out["bytes_sent"] = sent
        sock.close()
    return out


async def poll_health(client: httpx.AsyncClient, stop: asyncio.Event, pid: int | None,
                      latencies: list[float], rss: list[float]) -> Counter[str]:  # fmt: skip
    """GET /health every 20 ms until `stop`; also samples the API RSS (its peak matters, not only the end)."""
    statuses: Counter[str] = Counter()
    while not stop.is_set():
        t = time.perf_counter()
        try:
            statuses[str((await client.get("/health", timeout=5.0)).status_code)] += 1
        except httpx.HTTPError as exc:
            statuses[type(exc).__name__] += 1
        latencies.append(time.perf_counter() - t)
        if (m := rss_mb(pid)) is not None:
            rss.append(m)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.02)
    return statuses


async def scenario_big_body(p: Probe, client: httpx.AsyncClient) -> dict[str, Any]:
    body = big_json_body(int(p.args.big_body_mb * 1_000_000))
    parts = urlsplit(p.url)
    headers = {"Authorization": f"Bearer {p.args.api_key}"} if p.args.api_key else {}
    rss_before = rss_mb(p.pid)
    latencies: list[float] = []
    rss: list[float] = []
    stop = asyncio.Event()
    async with p.client() as health_client:  # its own connection: /health must not queue behind the upload
        poller = asyncio.create_task(poll_health(health_client, stop, p.pid, latencies, rss))
        await asyncio.sleep(0.2)  # a baseline of /health before the upload
        baseline = len(latencies)
        try:
            raw = await post_raw(parts.hostname or "127.0.0.1", parts.port or 80, COMPLETIONS, body, headers,
                                 p.args.big_body_timeout)  # fmt: skip
        finally:
            await asyncio.sleep(0.3)  # the server may still be busy with the body after answering
            stop.set()
            statuses = await poller
    rss_after = rss_mb(p.pid)
    during = latencies[baseline:]
    out = {"body_bytes": len(body), **raw, "health_polls": len(latencies), "health_statuses": dict(statuses),
           "health_baseline_max_ms": round(max(latencies[:baseline], default=0.0) * 1000, 2),
           "health_max_ms": round(max(during, default=0.0) * 1000, 2), "health_ms": stats_ms(during),
           "api_rss_mb_before": rss_before, "api_rss_mb_peak": max(rss, default=None),
           "api_rss_mb_after": rss_after, "api_rss_growth_mb": rss_delta(rss_before, rss_after)}  # fmt: skip
    failures = []
    if raw["status"] != 413:
        failures.append(f"status {raw['status']}, expected 413")
    if raw["status_s"] is None or raw["status_s"] > BIG_BODY_STATUS_S:
        failures.append(f"status after {raw['status_s']} s, expected under {BIG_BODY_STATUS_S} s")
    if max(during, default=0.0) > HEALTH_MAX_S:
        failures.append(f"/health took up to {out['health_max_ms']} ms, expected under {HEALTH_MAX_S * 1000:g}")
    if set(statuses) - {"200"}:
        failures.append(f"/health answered {dict(statuses)}")
    if out["api_rss_growth_mb"] is not None and out["api_rss_growth_mb"] > RSS_GROWTH_MB:
        failures.append(f"API RSS grew by {out['api_rss_growth_mb']} MB, expected under {RSS_GROWTH_MB:g}")
    out["failures"] = failures
    return out


async def scenario_hostile(p: Probe, client: httpx.AsyncClient) -> dict[str, Any]:
    count, max_tokens = p.args.hostile_streams, p.args.hostile_tokens
    restarts_before = await restarts(client)
    outcomes = [Outcome() for _ in range(count)]
    prompts = [f"Write a story about a {WORDS[i % len(WORDS)]}." for i in range(count)]
    coros = [stream_request(client, CHAT, chat_stream_body(p.model, text, max_tokens), o=o)
             for text, o in zip(prompts, outcomes, strict=True)]  # fmt: skip
    streams = asyncio.ensure_future(bounded_gather(coros, p.args.scenario_timeout))
    # The hostile request goes in once every stream is generating, so it shares their batch.
    deadline = time.perf_counter() + min(60.0, p.args.scenario_timeout)
    while time.perf_counter() < deadline and not streams.done():
        if all(o.content_chunks or o.status not in (None, 200) or o.exception for o in outcomes):
            break
        await asyncio.sleep(0.01)
    running = sum(not o.done and not o.exception and o.status in (None, 200) for o in outcomes)
    hostile = {"model": p.model, "prompt": "Hello", "max_tokens": 8, "temperature": 0.8, "top_k": 2**63}
    h = await json_request(client, COMPLETIONS, hostile)
    results, timed_out = await streams
    health, restarts_after = await health_status(client), await restarts(client)
    checked = [None if o is None else (o, problem(o, True, 1, (max_tokens, max_tokens), frozenset({"length"})))
               for o in results]  # fmt: skip
    out = {"hostile_body": {k: v for k, v in hostile.items() if k != "model"}, "hostile_status": h.status,
           "hostile_response": h.body or h.exception or "(200 with a completion)", "hostile_s": round(h.e2e, 3),
           "streams": count, "stream_max_tokens": max_tokens, "streams_running_at_hostile": running,
           **tally(checked), "health_after": health,
           "engine_restarts": None if restarts_before is None or restarts_after is None
           else restarts_after - restarts_before, "timed_out": timed_out}  # fmt: skip
    failures = []
    if h.status != 400:
        failures.append(f"hostile request answered {h.status}, expected 400")
    if out["errors"] or out["unfinished"]:
        failures.append(f"{out['errors'] + out['unfinished']} of {count} streams did not finish with full output")
    if health != 200:
        failures.append(f"/health {health} after the hostile request")
    if out["engine_restarts"]:
        failures.append(f"the engine core restarted {out['engine_restarts']:g} times")
    out["failures"] = failures
    if not running:  # a note, not the server's fault: raise --hostile-tokens
        out["note"] = "every stream had finished before the hostile request was sent"
    return out


RUNNERS: dict[str, Callable[[Probe, httpx.AsyncClient], Awaitable[dict[str, Any]]]] = {
    "streams": scenario_streams, "mix": scenario_mix, "big-body": scenario_big_body, "hostile": scenario_hostile,
}  # fmt: skip


async def probe(p: Probe, names: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    async with p.client() as client:
        try:
            p.model = p.args.model or await served_model(client)
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            return {n: {"ok": False, "failures": [f"server unreachable: {type(exc).__name__}: {exc}"[:300]]}
                    for n in names}  # fmt: skip
        for name in names:
            print(f"-- {name} ...", flush=True)
            start = time.perf_counter()
            try:
                res = await RUNNERS[name](p, client)
            except Exception as exc:  # a probe bug or a dead server: report it, go on with the next scenario
                res = {"failures": [f"probe error: {type(exc).__name__}: {exc}"[:300]]}
            res["ok"] = not res["failures"]
            res["scenario_s"] = round(time.perf_counter() - start, 3)
            out[name] = res
            print(f"   {'ok' if res['ok'] else 'FAIL'} in {res['scenario_s']:.1f} s", flush=True)
    return out


# ---------------------------------------------------------------- launching and output


class LaunchedServer:
    """launch.py on a free loopback port, its output in a log file; stopped with SIGTERM like a process manager."""

    def __init__(self, server_args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "launch.py", "--host", "127.0.0.1", "--port", str(self.port), *server_args]
        fd, log = tempfile.mkstemp(prefix="roseinfer-reliability-", suffix=".log")
        self.log = Path(log)
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # never reach for the network
        with os.fdopen(fd, "wb") as f:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"launch.py exited with {self.proc.returncode}; log {self.log}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.stop()
        raise SystemExit(f"launch.py not healthy after {timeout:.0f} s; log {self.log}:\n{self.tail()}")

    def stop(self, timeout: float = 60.0) -> dict[str, Any]:
        start = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # only our own child, by its pid
            self.proc.wait()
            code = None
        lines = self.log.read_text(errors="replace").splitlines()
        return {"exit_code": code, "stop_s": round(time.perf_counter() - start, 2), "log": str(self.log),
                "log_tracebacks": sum(line.startswith("Traceback (most recent call last)") for line in lines),
                "log_error_lines": sum(" ERROR " in line or line.startswith("ERROR") for line in lines)}  # fmt: skip

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def print_table(scenarios: dict[str, dict[str, Any]]) -> None:
    keys = {"streams": ("sent", "errors", "unfinished", "wall_s"),
            "mix": ("sent", "errors", "closed_mid_stream", "wall_s", "after", "api_rss_growth_mb"),
            "big-body": ("status", "status_s", "bytes_sent_at_status", "health_max_ms", "api_rss_growth_mb"),
            "hostile": ("hostile_status", "streams_running_at_hostile", "errors", "unfinished",
                        "health_after")}  # fmt: skip
    print(f"{' Reliability probe ':=^100}")
    for name, res in scenarios.items():
        nums = ", ".join(f"{k}={res[k]}" for k in keys.get(name, ()) if k in res)
        print(f"{name:<10}{'ok' if res['ok'] else 'FAIL':<6}{nums}")
        for failure in res["failures"]:
            print(f"{'':<16}- {failure}")
        for err in res.get("first_errors", [])[:3]:
            print(f"{'':<16}  e.g. {err}")
    print("=" * 100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = parser.add_argument
    a("--url", default=None, help="a running server (loopback only); default with --launch: its own")
    a("--pid", type=int, default=None, help="with --url: the API process (launch.py), to read its RSS")
    a("--launch", action="store_true", help="start launch.py on a free port for the probe, stop it afterwards")
    a("--server-args", default="--log-level warning", help="with --launch: extra launch.py flags (one string)")
    a("--launch-timeout", type=float, default=600.0, help="seconds for a launched server to get healthy")
    a("--api-key", default=None)
    a("--model", default=None, help="default: the first model the server lists at /v1/models")
    a("--scenarios", default="all", help=f"all, or comma-separated of {', '.join(SCENARIOS)}")
    a("--scale", type=float, default=1.0, help="multiplies the streams and mix counts (0.05: a smoke run)")
    a("--streams", type=int, default=512, help="concurrent streams of the streams scenario")
    a("--stream-tokens", type=int, default=16, help="max_tokens of each stream there")
    a("--mix", type=int, default=3000, help="requests of the mix scenario")
    a("--mix-concurrency", type=int, default=64)
    a("--big-body-mb", type=float, default=20.0, help="size of the oversized body (1 MB = 10^6 bytes)")
    a("--big-body-timeout", type=float, default=120.0, help="seconds to wait for its status line")
    a("--hostile-streams", type=int, default=8)
    a("--hostile-tokens", type=int, default=128, help="max_tokens of those streams: enough to outlast the request")
    a("--request-timeout", type=float, default=300.0, help="seconds without progress before a request fails")
    a("--scenario-timeout", type=float, default=900.0, help="seconds before a scenario's requests are cut off")
    a("--drain-timeout", type=float, default=60.0, help="seconds for the engine to get idle after the mix")
    a("--seed", type=int, default=0)
    a("--result-json", default=str(REPO / "bench" / "results" / "reliability.json"))
    args = parser.parse_args(argv)
    if (args.url is None) == (not args.launch):
        parser.error("give exactly one of --url and --launch")
    if args.url is not None and not is_loopback(args.url):
        parser.error(f"--url must be a loopback address (127.0.0.1, ::1, localhost), not {args.url}")
    names = list(SCENARIOS) if args.scenarios == "all" else [s.strip() for s in args.scenarios.split(",")]
    if unknown := [s for s in names if s not in SCENARIOS]:
        parser.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    args.scenario_names = names
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server: LaunchedServer | None = None
    server_info: dict[str, Any] = {}
    if args.launch:
        server = LaunchedServer(shlex.split(args.server_args))
        print(f"launching: {shlex.join(server.cmd)} (log {server.log})", flush=True)
        server.wait_healthy(args.launch_timeout)
        url, pid = server.url, server.proc.pid
    else:
        url, pid = args.url.rstrip("/"), args.pid
    try:
        p = Probe(args, url, pid)
        scenarios = asyncio.run(probe(p, args.scenario_names))
    finally:
        if server is not None:
            server_info = server.stop()
    settings = {k: v for k, v in vars(args).items() if k not in ("api_key", "scenario_names")}
    settings.update(url=url, api_pid=pid, api_key_set=bool(args.api_key), model=p.model, machine=machine(),
                    date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                    load_avg_1m=os.getloadavg()[0])  # fmt: skip
    result = {"settings": settings, "server": server_info or None, "scenarios": scenarios,
              "ok": all(s["ok"] for s in scenarios.values())}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.result_json)), exist_ok=True)
    with open(args.result_json, "w") as f:
        json.dump(result, f, indent=2)
    print_table(scenarios)
    if server_info:
        print(f"server stopped: exit code {server_info['exit_code']} in {server_info['stop_s']} s, "
              f"{server_info['log_tracebacks']} tracebacks in {server_info['log']}")  # fmt: skip
    print(f"results: {args.result_json}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
