"""HttpGuard: the HTTP boundary every request crosses first: request ids, the API key, body size and time limits,
and the last-resort error answer, so that no exception reaches uvicorn as a bare 500 and a closed connection."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import hmac
import logging
import time
import uuid

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.config import ServerConfig
from frontend.errors import ApiError

log = logging.getLogger("roseinfer.frontend")
# Bodies this large leave megabytes of freed parser and tokenizer memory that glibc keeps; hand it back.
_TRIM_AFTER_BYTES = 1 << 20


def route_path(scope: Scope) -> str:
    """The path the routes see. Behind --root-path, uvicorn puts the prefix in front of every request's path (and
    Starlette's routing takes it off again): the key's open paths and the error shape go by the route."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


class BodyRefused(HTTPException):
    """Raised from receive(): an HTTPException, so that FastAPI's body reading re-raises it instead of turning it
    into its own 400, and the app's handler answers with `error` (api_server.py)."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.status, error.message)
        self.error = error


class HttpGuard:
    """Pure ASGI (BaseHTTPMiddleware would hide client disconnects from streaming responses)."""

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app = app
        self.expected = f"Bearer {config.api_key}".encode() if config.api_key else None
        self.key = config.api_key.encode() if config.api_key else b""  # Anthropic's clients send it as x-api-key
        self.open_paths = frozenset() if config.api_key_on_health else frozenset({"/health", "/ping", "/metrics"})
        self.max_bytes = config.max_request_bytes
        self.body_timeout = config.body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if scope["method"] == "POST" and "json" not in headers.get("content-type", ""):
            # Every body here is JSON whatever the header says (curl -d sends a form content type).
            raw = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope["headers"] = [*raw, (b"content-type", b"application/json")]
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        echo = (b"x-request-id", request_id.encode("latin-1"))
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), echo]
            await send(message)

        refusal = self._refusal(scope, headers)
        if refusal is not None:  # answered before a byte of the body is read (uvicorn discards the rest)
            await refusal.response(path=route_path(scope))(scope, receive, send_with_id)
            return
        length = int(headers.get("content-length") or 0)
        try:
            await self.app(scope, self._limited(receive), send_with_id)
        except BodyRefused as exc:
            if not started:
                await exc.error.response(path=route_path(scope))(scope, receive, send_with_id)
        except Exception as exc:
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if not started:  # once a response has started, ending it is all that is left to do
                error = ApiError(500, f"internal error: {type(exc).__name__}", None, "internal_error")
                await error.response(path=route_path(scope))(scope, receive, send_with_id)
        finally:
            if length >= _TRIM_AFTER_BYTES:
                _return_freed_memory()

    def _refusal(self, scope: Scope, headers: Headers) -> ApiError | None:
        if self.expected and scope["method"] != "OPTIONS" and route_path(scope) not in self.open_paths:
            given = headers.get("authorization", "").encode("latin-1")
            given_key = headers.get("x-api-key", "").encode("latin-1")
            if not (hmac.compare_digest(given, self.expected) or hmac.compare_digest(given_key, self.key)):
                return ApiError(401, "Incorrect or missing API key (Authorization: Bearer ..., or x-api-key)", None,
                                "invalid_api_key")  # fmt: skip
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return _too_large(self.max_bytes)
        return None

    def _limited(self, receive: Receive) -> Receive:
        """receive() with the body capped in size (chunked bodies have no Content-Length) and in time."""
        received = 0
        deadline = time.monotonic() + self.body_timeout
        body_done = False

        async def limited() -> Message:
            nonlocal received, body_done
            if body_done:  # after the body only the disconnect comes, whenever the client leaves
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise BodyRefused(ApiError(408, f"the request body did not arrive within {self.body_timeout:g} s "
                                                 "(--body-timeout)", None, "request_timeout")) from None  # fmt: skip
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_bytes:
                    raise BodyRefused(_too_large(self.max_bytes))
            else:
                body_done = True
            return message

        return limited


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes (--max-request-bytes)", None,
                    "request_too_large")  # fmt: skip


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return None


def _return_freed_memory() -> None:
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
