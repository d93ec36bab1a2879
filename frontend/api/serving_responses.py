"""POST /v1/responses (OpenAI's Responses API) on the chat path: the request is translated into a chat request
(protocol_responses.py), after the items it continues (a stored response's chain, previous_response_id, or a
conversation's), which start_chat checks, admits, renders and sends; the engine's text goes through the chat path's
parsers (reasoning, tool calls) into output items (responses_output.py), returned whole, streamed as Responses
events, or kept for polling (background); the finished response is stored (responses_store.py) for GET, its
input_items and the next turn, and added to its conversation (conversations.py)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from frontend.api.protocol_responses import (
    FunctionCallOutputItem,
    InputItem,
    ResponsesRequest,
    chat_request,
    in_responses_terms,
    item_dumps,
    own_items,
    refuse_state,
    turn_items,
)
from frontend.api.responses_output import OutputBuilder
from frontend.api.responses_store import Replay, with_id
from frontend.api.serving import ClosingStreamingResponse, ServingContext, collect, off_loop
from frontend.api.serving_chat import chat_prompt, start_chat
from frontend.api.sse import dumps
from frontend.engine.fanout import FanOut
from frontend.errors import ApiError
from frontend.tools.reasoning import with_reasoning
from frontend.tools.tool_calls import plan_tools
from frontend.tools.tool_parsers import ToolParser, parser_events

log = logging.getLogger("roseinfer.api")


def status_of(finish_reason: str | None) -> str:
    """The length limit (max_output_tokens, or the context) leaves a response incomplete."""
    return "incomplete" if finish_reason == "length" else "completed"


def usage(fan: FanOut) -> dict[str, Any]:
    counts = fan.usage()
    cached = fan.num_cached_tokens
    reasoning = counts.get("completion_tokens_details", {}).get("reasoning_tokens", 0)
    return {"input_tokens": counts["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": counts["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": counts["total_tokens"]}  # fmt: skip


class Envelope:
    """The response object around the output: its id, the request's settings echoed, status and usage; `final`
    builds the last one and stores it where the request asked (store, the default)."""

    def __init__(self, ctx: ServingContext, req: ResponsesRequest, rid: str) -> None:
        self.head = {"id": rid, "object": "response", "created_at": int(time.time()),
                     "model": ctx.served_name(req.model)}  # fmt: skip
        self.store = ctx.responses if req.store and ctx.responses.enabled else None
        self.echo = req.echo(ctx.sampling_defaults, self.store is not None)
        self.items = [with_id(item) for item in item_dumps(own_items(req))]
        self.previous = req.previous_response_id
        self.conversation, self.conversations = req.conversation_id, ctx.conversations

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        completed_at = int(time.time()) if status == "completed" else None
        return {**self.head, "status": status, "completed_at": completed_at, "error": error,
                "incomplete_details": incomplete, "output": output, "usage": usage, **self.echo}  # fmt: skip

    def final(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
              error: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        body = self.body(status, output, usage, error)
        if self.store is not None:
            self.store.put(self.head["id"], body, self.items, self.previous)
        if status in ("completed", "incomplete") and self.conversation in self.conversations:  # the turn joins it
            self.conversations.add(self.conversation, [*self.items, *output])
        return body


async def _events(ctx: ServingContext, fan: FanOut, parser: ToolParser | None, envelope: Envelope,
                  record: Callable[[bytes], None] | None = None) -> AsyncIterator[bytes]:  # fmt: skip
    """created, in_progress, the output items' events as the text comes, then completed or incomplete (with the
    whole response); a failure in the engine ends the stream with response.failed. `record` sees each event."""
    numbers = itertools.count()

    def sse(event: dict[str, Any]) -> bytes:
        event = {"type": event["type"], "sequence_number": next(numbers), **event}
        data = f"event: {event['type']}\ndata: {dumps(event)}\n\n".encode()
        if record is not None:
            record(data)
        return data

    builder, finish = OutputBuilder(), None
    try:
        yield sse({"type": "response.created", "response": envelope.body("in_progress", [], None)}) + \
            sse({"type": "response.in_progress", "response": envelope.body("in_progress", [], None)})  # fmt: skip
        async for _, delta in fan.deltas():
            if delta.finish_reason == "error":
                err = ctx.failure(delta.error, delta.error_code)
                error = {"code": err.code or "server_error", "message": err.message}
                yield sse({"type": "response.failed", "response": envelope.final("failed", builder.output(),
                                                                                usage(fan), error)})  # fmt: skip
                return
            events = builder.feed(parser_events(parser, delta.text, delta.finish_reason is not None))
            if delta.finish_reason is not None:
                finish = delta.finish_reason
                events += builder.finish(status_of(finish))
            if events:
                yield b"".join(sse(e) for e in events)
        status = status_of(finish)
        yield sse({"type": f"response.{status}", "response": envelope.final(status, builder.output(), usage(fan))})
    finally:
        fan.abort()


async def fitted(ctx: ServingContext, req: ResponsesRequest, items: list[InputItem]) -> list[InputItem]:
    """truncation auto: the items less the fewest oldest ones that let the prompt and max_output_tokens (at least
    one token) fit the context, as OpenAI drops them; the newest is always kept (if it alone is too long, the
    request's 400 says so). Each candidate is rendered as the request would be, halving the range each time."""
    if len(items) < 2:
        return items
    room = ctx.max_model_len - (req.max_output_tokens or 1)
    # The tools the template shows do not depend on the items: planned once (their schemas checked once).
    template_tools = (await off_loop(plan_tools, chat_request(req, items), ctx.tool_call_parser)).template_tools

    def tail(k: int) -> list[InputItem]:  # a call's output whose call was dropped goes with it
        rest = items[k:]
        while len(rest) > 1 and isinstance(rest[0], FunctionCallOutputItem):
            rest = rest[1:]
        return rest

    async def fits(k: int) -> bool:
        prompt = await off_loop(chat_prompt, ctx, chat_request(req, tail(k)).messages, True, template_tools)
        return len(prompt) <= room

    if await fits(0):
        return items
    low, high = 1, len(items) - 1  # the fewest dropped that may fit, and the most there is to drop
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if await fits(middle) else (middle + 1, high)
    return tail(low)


def whole_output(parser: ToolParser | None, result: Any) -> tuple[str, list[dict[str, Any]]]:
    """A finished choice's status and output items."""
    status = status_of(result.finish_reason)
    builder = OutputBuilder()
    builder.feed(parser_events(parser, result.text, True))
    builder.finish(status)
    return status, builder.output()


def run_in_background(ctx: ServingContext, fan: FanOut, parser: ToolParser | None, envelope: Envelope,
                      stream: bool) -> Response:  # fmt: skip
    """background: the request runs on, whoever listens, while its client polls GET (the stored response,
    in_progress until it ends) or reads its events (stream: from a Replay, which a client that lost the stream
    resumes with GET ?stream=true); POST .../cancel aborts it (the store's `running` holds how)."""
    rid = envelope.head["id"]
    replay = Replay() if stream else None

    async def run() -> None:
        try:
            if replay is not None:
                async for _ in _events(ctx, fan, parser, envelope, replay.add):
                    pass
                return
            result = (await fan.collect())[0].result
            if result.finish_reason == "error":
                err = ctx.failure(result.error, result.error_code)
                envelope.final("failed", [], usage(fan), {"code": err.code or "server_error", "message": err.message})
            else:
                envelope.final(*whole_output(parser, result), usage(fan))
        except Exception as exc:  # never left in_progress for its client to poll forever
            log.exception("background response %s failed", rid)
            envelope.final("failed", [], None, {"code": "server_error", "message": f"internal error: {exc}"})
        finally:
            fan.abort()
            ctx.responses.running.pop(rid, None)
            if replay is not None:
                ctx.responses.replays.pop(rid, None)
                replay.finish()

    task = asyncio.ensure_future(run())

    def cancel() -> dict[str, Any]:
        task.cancel()
        fan.abort()
        ctx.responses.running.pop(rid, None)
        return envelope.final("cancelled", [], usage(fan))

    ctx.responses.running[rid] = cancel
    started = envelope.final("in_progress", [], None)
    if replay is None:
        return JSONResponse(started)
    ctx.responses.replays[rid] = replay
    return StreamingResponse(replay.follow(-1), media_type="text/event-stream")  # a client gone stops nothing


async def create_response(ctx: ServingContext, req: ResponsesRequest, raw: Request) -> Response:
    # The id names a stored object, so the server makes it: one from a client's X-Request-Id could replace another
    # response, or continue itself (a chain without an end).
    rid = f"resp_{uuid.uuid4().hex}"
    refuse_state(req, ctx.responses.enabled)
    if req.conversation_id is not None:
        history = ctx.conversations.get(req.conversation_id).items
    elif req.previous_response_id is not None:
        history = ctx.responses.conversation(req.previous_response_id)
    else:
        history = []
    items = turn_items(req, history)
    try:
        if req.truncation == "auto":
            items = await fitted(ctx, req, items)
        fan, tools = await start_chat(ctx, chat_request(req, items), rid)
    except ApiError as exc:
        raise in_responses_terms(exc) from None
    make_parser = with_reasoning(ctx.reasoning_parser, tools.make_parser(), fan.params.structured)
    parser = make_parser() if make_parser is not None else None
    envelope = Envelope(ctx, req, rid)
    if req.background:
        return run_in_background(ctx, fan, parser, envelope, req.stream)
    if req.stream:
        return ClosingStreamingResponse(_events(ctx, fan, parser, envelope), fan.abort, "text/event-stream")
    choices = await collect(ctx, raw, fan)
    if choices is None:
        return Response(status_code=499)  # the client left; its request was aborted
    return JSONResponse(envelope.final(*whole_output(parser, choices[0].result), usage(fan)))


def cancel_response(ctx: ServingContext, rid: str) -> dict[str, Any]:
    """POST /v1/responses/{rid}/cancel: a background response still running ends as cancelled."""
    cancel = ctx.responses.running.get(rid)
    if cancel is None:
        status = ctx.responses.get(rid).response["status"]  # a 404 if it is not stored
        raise ApiError(400, f"Response '{rid}' is {status}: only a background response in progress can be "
                       "cancelled.", "response_id", "invalid_value")  # fmt: skip
    return cancel()


def delete_response(ctx: ServingContext, rid: str) -> dict[str, Any]:
    ctx.responses.get(rid)  # a 404 if it is not stored
    if rid in ctx.responses.running:  # a background response still running: it is cancelled first
        ctx.responses.running[rid]()
    ctx.responses.delete(rid)
    return {"id": rid, "object": "response", "deleted": True}
