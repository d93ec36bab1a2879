"""POST /v1/messages (Anthropic's Messages API) on the chat path: the request is translated into a chat request
(protocol_messages.py), which start_chat checks, admits, renders and sends; the engine's text goes through the chat
path's parsers (reasoning, tool calls) into content blocks (messages_output.py), returned whole or streamed as
Anthropic's events. POST /v1/messages/count_tokens renders the same prompt and counts it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from frontend.api.messages_output import ContentBuilder
from frontend.api.protocol_messages import CountTokensRequest, MessagesRequest, chat_request, in_messages_terms
from frontend.api.serving import ClosingStreamingResponse, ServingContext, collect, off_loop
from frontend.api.serving_chat import chat_prompt, start_chat
from frontend.engine.fanout import FanOut
from frontend.errors import ApiError, anthropic_body
from frontend.tools.reasoning import with_reasoning
from frontend.tools.tool_calls import functions_as_tools, plan_tools
from frontend.tools.tool_parsers import ToolParser, parser_events


def stop_reason(finish: str | None, stopped_by: str | int | None, builder: ContentBuilder,
                stops: list[str]) -> tuple[str, str | None]:  # fmt: skip
    """Anthropic's stop_reason and stop_sequence: the length limit, a stop sequence, a tool call or the turn's end."""
    if finish == "length":
        return "max_tokens", None
    if isinstance(stopped_by, str) and stopped_by in stops:
        return "stop_sequence", stopped_by
    return ("tool_use" if builder.calls else "end_turn"), None


def usage(fan: FanOut) -> dict[str, Any]:
    """Anthropic counts the prompt tokens read from its cache apart from the others."""
    counts = fan.usage()
    cached = fan.num_cached_tokens
    return {"input_tokens": counts["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": counts["completion_tokens"]}  # fmt: skip


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


async def _events(ctx: ServingContext, fan: FanOut, parser: ToolParser | None, head: dict[str, Any],
                  stops: list[str]) -> AsyncIterator[bytes]:  # fmt: skip
    """message_start, the content blocks' events as the text comes, message_delta (stop reason, usage) and
    message_stop; a failure in the engine ends the stream with an error event."""
    builder, finish, stopped_by = ContentBuilder(), None, None
    try:
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(fan)}
        yield sse({"type": "message_start", "message": start})
        async for _, delta in fan.deltas():
            if delta.finish_reason == "error":
                err = ctx.failure(delta.error, delta.error_code)
                yield sse(anthropic_body(err.status, err.message))
                return
            events = builder.feed(parser_events(parser, delta.text, delta.finish_reason is not None))
            if delta.finish_reason is not None:
                finish, stopped_by = delta.finish_reason, delta.stop_reason
                events += builder.finish()
            if events:
                yield b"".join(sse(e) for e in events)
        reason, sequence = stop_reason(finish, stopped_by, builder, stops)
        yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                   "usage": usage(fan)}) + sse({"type": "message_stop"})  # fmt: skip
    finally:
        fan.abort()


async def create_message(ctx: ServingContext, req: MessagesRequest, raw: Request, request_id: str) -> Response:
    rid = f"msg_{request_id}"
    try:
        fan, tools = await start_chat(ctx, chat_request(req), rid, clamp=True)
    except ApiError as exc:
        raise in_messages_terms(exc) from None
    make_parser = with_reasoning(ctx.reasoning_parser, tools.make_parser(), fan.params.structured)
    parser = make_parser() if make_parser is not None else None
    head = {"id": rid, "type": "message", "role": "assistant", "model": ctx.served_name(req.model)}
    stops = req.stop_sequences or []
    if req.stream:
        return ClosingStreamingResponse(_events(ctx, fan, parser, head, stops), fan.abort, "text/event-stream")
    choices = await collect(ctx, raw, fan)
    if choices is None:
        return Response(status_code=499)  # the client left; its request was aborted
    result = choices[0].result
    builder = ContentBuilder()
    builder.feed(parser_events(parser, result.text, True))
    builder.finish()
    reason, sequence = stop_reason(result.finish_reason, result.stop_reason, builder, stops)
    return JSONResponse({**head, "content": builder.content(), "stop_reason": reason, "stop_sequence": sequence,
                         "usage": usage(fan)})  # fmt: skip


async def count_tokens(ctx: ServingContext, req: CountTokensRequest) -> dict[str, int]:
    """The prompt's length as /v1/messages would render it (its tools in the template too)."""
    ctx.check_model(req.model)
    try:
        chat = functions_as_tools(chat_request(req.as_messages_request()))
        tools = await off_loop(plan_tools, chat, ctx.tool_call_parser) if chat.tools else plan_tools(chat, None)
        prompt = await off_loop(chat_prompt, ctx, chat.messages, True, tools.template_tools, False,
                                chat.chat_template_kwargs)  # fmt: skip
    except ApiError as exc:
        raise in_messages_terms(exc) from None
    return {"input_tokens": len(prompt)}
