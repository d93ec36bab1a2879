"""ApiError and the OpenAI error shape {"error": {"message", "type", "param", "code"}} every failure is sent in."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "service_unavailable"}  # fmt: skip


class EngineUnavailable(RuntimeError):
    """The engine core is dead, restarting or not ready: the request cannot run (HTTP 503)."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self, headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
        """OpenAI's error shape; Anthropic's on its Messages API routes (`path`: the request's)."""
        body = anthropic_body(self.status, self.message) if path.startswith("/v1/messages") else self.body()
        return JSONResponse(body, status_code=self.status, headers={**(self.headers or {}), **(headers or {})})


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def _printable(text: str | None) -> str | None:
    """Error messages quote user input, which may hold lone surrogates: JSON encoding must never fail on them."""
    return None if text is None else text.encode("utf-8", "replace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    error_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": _printable(message), "type": error_type, "param": _printable(param), "code": code}}


# Anthropic's error types (the Messages API, /v1/messages): its clients read them from the body
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}  # fmt: skip


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape, for its Messages API routes (and a stream's error event)."""
    error_type = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": error_type, "message": _printable(message)}}


def sse_error(status: int, message: str, code: str | None = None) -> str:
    """An error after a stream started: one `data:` event with the error body (then the caller sends [DONE])."""
    return f"data: {json.dumps(error_body(status, message, None, code))}\n\n"


def from_validation_errors(errors: list[dict[str, Any]]) -> ApiError:
    """pydantic's errors -> one 400 naming the first offending field (never FastAPI's default 422)."""
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    # A value that fits no member of a union fails once per member; the member that says more than
    # "wrong type" (e.g. a list with too many items) explains it best.
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:2] == tuple(first.get("loc", ()))[:2]]
    first = next((e for e in same_field if not str(e.get("type", "")).endswith("_type")), first)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if len(loc) > 1 and loc[0] in ("query", "path"):  # a URL's parameter, as FastAPI places it
        loc = loc[1:]
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "),
                           None, "invalid_json")  # fmt: skip
    if not loc:
        return bad_request(f"request body: {first.get('msg', 'invalid')}", None, "invalid_type")
    # Union members show up as pseudo-fields such as "list[int]"; the first element is the request field.
    path = ".".join(p for p in loc if "[" not in p)
    kind = str(first.get("type", ""))
    code = "missing_required_parameter" if kind == "missing" else "invalid_type" if "type" in kind else "invalid_value"
    return bad_request(f"{path}: {first.get('msg', 'invalid value')}", loc[0], code)
