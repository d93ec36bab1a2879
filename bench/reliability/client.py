"""The probe's HTTP side: streaming and plain requests, bounded gathering, the server's Prometheus gauges."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Coroutine
from typing import Any

import httpx

from bench.reliability.outcome import Outcome, read_event

METRIC_RUNNING = "roseinfer:num_requests_running"
METRIC_WAITING = "roseinfer:num_requests_waiting"
METRIC_BLOCKS = "roseinfer:kv_cache_blocks_in_use"
METRIC_RESTARTS = "roseinfer:engine_restarts_total"


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
