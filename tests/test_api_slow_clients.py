"""Slow and many clients: --header-timeout cuts slowloris connections, --max-connections answers 503 past the cap,
many streams share SSE events (--stream-merge-above)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import time

import httpx
import pytest
import torch

from tests.conftest import Server

HEADER_TIMEOUT = 1.0
MAX_CONNECTIONS = 60
MODEL = "SmolLM2-135M-Instruct"
# Tokens per stream of the 48 sent at once: enough that they overlap. On an H100 the test failed with 24, likely
# because the first streams finished before the last arrived and too few were ever in flight for the pacing to merge.
MANY_STREAMS_TOKENS = 256 if torch.cuda.is_available() else 24
MARGIN = 4.0  # a busy 2-core machine may be late to close; today's code never closes them at all


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    server = Server(tmp_path_factory.mktemp("slow_clients"), "--header-timeout", str(HEADER_TIMEOUT),
                    "--max-connections", str(MAX_CONNECTIONS), "--stream-max-hold", "60")  # fmt: skip
    yield server.wait_healthy()
    server.assert_clean_exit()


def _connect(server: Server, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    if first:
        sock.sendall(first)
    return sock


def _read_response(sock: socket.socket) -> bytes:
    """One whole HTTP response (head and Content-Length body): the next read then starts at the next response."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096) or b""
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def _read_until_closed(socks: list[socket.socket], deadline: float, trickle_until: float = 0.0) -> list[bytes | None]:
    """What each socket received before the server closed it (None: reset), trickling a header byte every 0.1 s
    until `trickle_until`; fails for any still open at `deadline`."""
    got: dict[socket.socket, bytes] = {s: b"" for s in socks}
    result: dict[socket.socket, bytes | None] = {}
    while len(result) < len(socks):
        now = time.monotonic()
        open_socks = [s for s in socks if s not in result]
        assert now < deadline, f"{len(open_socks)} of {len(socks)} slow connections still open"
        if now < trickle_until:
            for s in open_socks:
                with contextlib.suppress(OSError):  # the server may have closed it already
                    s.send(b"a")
        readable, _, _ = select.select(open_socks, [], [], 0.1)
        for s in readable:
            try:
                chunk = s.recv(4096)
            except ConnectionResetError:
                result[s] = None
                continue
            if chunk:
                got[s] += chunk
            else:
                result[s] = got[s]
    for s in socks:
        s.close()
    return [result[s] for s in socks]


def test_slow_headers_are_cut_while_others_are_served(server):
    start = time.monotonic()
    # A request line and part of a header, then one more byte every 0.1 s (the trickle must not extend the
    # deadline); plus connections that send nothing at all.
    slow = [_connect(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ") for _ in range(40)]
    silent = [_connect(server) for _ in range(10)]
    t0 = time.monotonic()
    r = httpx.get(server.url + "/health", timeout=5)
    assert r.status_code == 200 and time.monotonic() - t0 < 2.0  # served while 50 connections hang

    deadline = start + HEADER_TIMEOUT + MARGIN
    answers = _read_until_closed(slow, deadline, trickle_until=start + HEADER_TIMEOUT / 2)
    # A slow client is told why before the close, unless its own late bytes made the close a reset.
    assert all(a is None or a.startswith(b"HTTP/1.1 408 ") for a in answers), answers
    assert sum(a is not None for a in answers) > 0, "no slow connection got its 408"
    assert _read_until_closed(silent, deadline) == [b""] * len(silent)  # nothing asked, nothing answered
    assert time.monotonic() - start >= HEADER_TIMEOUT * 0.9  # not cut before the timeout either


def test_keep_alive_connection_gets_a_fresh_header_deadline(server):
    sock = _connect(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(5)
    assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
    time.sleep(HEADER_TIMEOUT * 0.6)  # within the deadline: the connection is still usable
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
    start = time.monotonic()
    sock.sendall(b"GET /health HTTP/1.1\r\n")  # then a third request that never finishes its head
    [answer] = _read_until_closed([sock], start + HEADER_TIMEOUT + MARGIN)
    assert answer is None or answer.startswith(b"HTTP/1.1 408 ")


def test_connection_cap_answers_503_then_recovers(server):
    # Each held connection has sent a complete head and half its body, so no header timeout applies to it.
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{"
    held = [_connect(server, head) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)  # let the server parse all the heads
        for _ in range(3):  # one connection past the cap: refused
            r = httpx.get(server.url + "/health", timeout=5)
            assert r.status_code == 503, r.text
        for sock in held[:5]:  # the held ones were admitted: they finish normally (the body is not a valid request)
            sock.sendall(b"}")
            sock.settimeout(5)
            status = sock.recv(4096).split(b"\r\n", 1)[0]
            assert status.startswith(b"HTTP/1.1 4") and b" 503 " not in status, status
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while (r := httpx.get(server.url + "/health", timeout=5)).status_code == 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.status_code == 200


def test_many_streams_merge_tokens_a_single_stream_does_not(server):
    """Above 16 streams in flight each SSE event carries several tokens (StreamPacing; --stream-max-hold 60 makes that
    independent of the machine's speed); the chunks still concatenate exactly, their logprobs align with their tokens,
    finish and usage come last. Alone, a stream gets one event per token."""

    async def one(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[list[dict], dict]:
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": max_tokens, "temperature": 0,
                "logprobs": 0, "ignore_eos": True, "skip_special_tokens": False, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with client.stream("POST", "/v1/completions", json=body) as r:
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"] == [] and chunks[-2]["choices"][0]["finish_reason"] == "length"
        return [c["choices"][0] for c in chunks[:-2]], chunks[-1]["usage"]

    async def run_all(n: int, max_tokens: int) -> list[tuple[list[dict], dict]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            return await asyncio.gather(*(one(c, i, max_tokens) for i in range(n)))

    for n, max_tokens in ((48, MANY_STREAMS_TOKENS), (1, 16)):
        results = asyncio.run(run_all(n, max_tokens))
        for choices, usage in results:
            assert usage["completion_tokens"] == max_tokens
            tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
            assert all(len(c["logprobs"]["tokens"]) == len(c["logprobs"]["token_logprobs"]) for c in choices)
            assert len(tokens) == max_tokens and "".join(c["text"] for c in choices) == "".join(tokens)
            assert all(c["finish_reason"] is None for c in choices)
        num_chunks = sum(len(choices) for choices, _ in results)
        if n == 1:
            assert num_chunks == max_tokens  # one chunk per token
        else:
            assert num_chunks < 0.75 * n * max_tokens, f"{num_chunks} SSE events for {n * max_tokens} tokens"
