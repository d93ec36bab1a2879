"""The big-body scenario: an oversized JSON body over a raw socket while /health is polled and the API RSS sampled."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.reliability.plan import COMPLETIONS
from bench.reliability.probe import Probe, rss_delta, rss_mb
from bench.serve_metrics import stats_ms

# What the server's design promises for an oversized body; a miss is reported as a failure.
BIG_BODY_STATUS_S = 0.1
HEALTH_MAX_S = 0.1
RSS_GROWTH_MB = 50.0


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
