"""HttpGuard on its own, at the ASGI level: body size and time limits, the API key's scope, the last-resort 500."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from common.config import ServerConfig
from frontend.api.http_guard import HttpGuard


async def _echo_body(scope, receive, send) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


async def _crash(scope, receive, send) -> None:
    raise RuntimeError("a bug in a route")


def call(app, path: str = "/v1/completions", chunks: list[bytes] | None = None, headers: dict[str, str] | None = None,
         stall: bool = False, **config: Any) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    """One request through HttpGuard(app); `stall`: the client stops sending after the chunks."""
    pending = list(chunks or [b""])
    sent: list[dict] = []

    async def receive() -> dict:
        if pending:
            body = pending.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(pending) or stall}
        await asyncio.sleep(3600 if stall else 0)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "POST", "path": path, "headers": raw}
    asyncio.run(HttpGuard(app, ServerConfig(**config))(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def test_declared_length_over_the_limit_is_413_without_reading():
    status, _, body = call(_echo_body, chunks=[b"x" * 10], headers={"content-length": "101"}, max_request_bytes=100)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"


def test_chunked_body_over_the_limit_is_413_while_reading():
    status, _, body = call(_echo_body, chunks=[b"x" * 60, b"x" * 60], max_request_bytes=100)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert call(_echo_body, chunks=[b"x" * 50, b"x" * 50], max_request_bytes=100)[:3:2] == (200, b"x" * 100)


def test_a_body_that_stops_arriving_is_408():
    status, _, body = call(_echo_body, chunks=[b"{"], stall=True, body_timeout=0.2)
    assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"


def test_an_unhandled_exception_is_an_openai_500_not_a_raise():
    status, headers, body = call(_crash)
    error = json.loads(body)["error"]
    assert status == 500 and set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    assert "x-request-id" in headers


def test_api_key_covers_every_route_but_health_and_metrics():
    key = {"api_key": "k"}
    assert call(_echo_body, path="/tokenize", **key)[0] == 401
    assert call(_echo_body, path="/tokenize", headers={"authorization": "Bearer k"}, **key)[0] == 200
    assert call(_echo_body, path="/health", **key)[0] == 200
    assert call(_echo_body, path="/metrics", api_key_on_health=True, **key)[0] == 401
