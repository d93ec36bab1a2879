"""The fuzzer's client side: sending an example's requests at once, and what is wrong with each answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx

from tests.fuzz_request_strategies import CHAT, CMPL, CONV, DETOK, GEN, MSGS, RESP, TOK, Req

ERROR_KEYS = {"message", "type", "param", "code"}
FINISH = {"stop", "length", "function_call"}  # function_call: a legacy `functions` request


def sse_events(text: str) -> Iterator[str]:
    for line in text.split("\n"):
        if line.startswith("data: "):
            yield line[6:]


def problems(req: Req, status: int, ctype: str, raw: bytes) -> list[str]:
    """What is wrong with one answer (an empty list: nothing)."""
    where = f"{req!r} -> {status} {raw[:600]!r}"
    if status == NO_ANSWER:
        return [f"no answer ({ctype}): {req!r}"]
    if status >= 500:
        return [f"5xx: {where}"]
    if 400 <= status < 500:
        anthropic = req.path == MSGS  # Anthropic's error shape on its Messages API
        try:
            answer = json.loads(raw)
            error = answer["error"]
            keys = {"type", "message"} if anthropic else ERROR_KEYS
            assert set(error) == keys and isinstance(error["message"], str) and error["message"]
            assert isinstance(error["type"], str) and error["type"] and (not anthropic or answer["type"] == "error")
        except (ValueError, KeyError, TypeError, AssertionError):
            return [f"not an {'Anthropic' if anthropic else 'OpenAI'} error: {where}"]
        return []
    if status != 200:
        return [f"unexpected status: {where}"]
    try:
        problem = _bad_200(req, ctype, raw.decode("utf-8"))
    except (ValueError, KeyError, TypeError, IndexError) as exc:  # not UTF-8, not JSON, or not shaped as it should
        problem = f"unreadable answer ({type(exc).__name__}: {exc})"
    return [f"{problem}: {where}"] if problem else []


def _bad_200(req: Req, ctype: str, text: str) -> str | None:
    if req.path == RESP:
        return _bad_response(ctype, text)
    if req.path == MSGS:
        return _bad_message(ctype, text)
    if req.path == CONV:
        answer = json.loads(text)
        return None if answer["object"] == "conversation" and answer["id"].startswith("conv_") else "not a conversation"
    if ctype.startswith("text/event-stream"):
        events = list(sse_events(text))
        if not events or events[-1] != "[DONE]":
            return "SSE without a final [DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        if any("error" in c for c in chunks):  # a failure after the 200 went out: a 5xx in all but status
            return f"error event in a stream {[c for c in chunks if 'error' in c]}"
        finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
        return None if finishes and set(finishes) <= FINISH else f"finish reasons {finishes}"
    if req.path == GEN:  # a failure mid-way ends the text with an "[error: ...]" line (serving.stream_text)
        return "/generate failed mid-stream" if "\n[error: " in text else None
    answer = json.loads(text)
    if req.path in (CMPL, CHAT):
        finishes = [c["finish_reason"] for c in answer["choices"]]
        return None if finishes and set(finishes) <= FINISH and answer["usage"] else f"finish reasons {finishes}"
    if req.path == TOK:
        return None if answer["count"] == len(answer["tokens"]) else "count != len(tokens)"
    if req.path == DETOK:
        return None if isinstance(answer["prompt"], str) else "prompt is not a string"
    return f"200 from {req.path}"


def _bad_response(ctype: str, text: str) -> str | None:
    """/v1/responses: a response object that completed (or hit its length limit), whole or as the last of a stream
    of numbered events (no [DONE] in this API); response.failed after the 200 is a 5xx in all but status."""
    if ctype.startswith("text/event-stream"):
        events = [json.loads(e) for e in sse_events(text)]
        if [e["sequence_number"] for e in events] != list(range(len(events))):
            return "events out of sequence"
        if not events or events[-1]["type"] not in RESPONSE_ENDS:
            return f"stream ends with {events[-1]['type'] if events else 'nothing'}"
        answer = events[-1]["response"]
    else:
        answer = json.loads(text)
    ok = answer["object"] == "response" and answer["status"] in ("completed", "incomplete") and answer["usage"]
    return None if ok else f"status {answer['status']}"


RESPONSE_ENDS = {"response.completed", "response.incomplete"}


def _bad_message(ctype: str, text: str) -> str | None:
    """/v1/messages: a message with a stop reason, whole or built by a stream that ends in message_stop (an error
    event after the 200 is a 5xx in all but status)."""
    if ctype.startswith("text/event-stream"):
        events = [json.loads(e) for e in sse_events(text)]
        kinds = [e["type"] for e in events]
        if not kinds or kinds[0] != "message_start" or kinds[-1] != "message_stop" or "error" in kinds:
            return f"stream of {kinds[:3]}...{kinds[-3:]}"
        reason = events[-2]["delta"]["stop_reason"]
    else:
        answer = json.loads(text)
        reason = answer["stop_reason"] if answer["type"] == "message" and answer["usage"] else None
    return None if reason in STOP_REASONS else f"stop reason {reason}"


STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use"}
NO_ANSWER = -1  # send()'s status when the server never answered in full: a timeout (a hang?) or a dropped connection


async def send(client: httpx.AsyncClient, req: Req) -> tuple[int, str, bytes]:
    headers = {"content-type": req.content_type} if req.content_type else {}
    try:
        async with client.stream("POST", req.path, content=req.content, headers=headers) as r:
            return r.status_code, r.headers.get("content-type", ""), await r.aread()  # streams read to their end
    except httpx.TransportError as exc:
        return NO_ANSWER, f"{type(exc).__name__}: {exc}", b""


async def send_all(url: str, reqs: list[Req]) -> list[tuple[int, str, bytes]]:
    # A generous read timeout: on the busy 2-core machine one engine step may take seconds; beyond it, a hang.
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120, connect=30)) as client:
        return await asyncio.gather(*(send(client, r) for r in reqs))
