"""SSE: a FanOut's deltas -> OpenAI chunk events, at as little CPU per token as the chunk's shape allows.

A plain text chunk (no logprobs, no tool calls) is its choice's fixed JSON around the JSON-escaped text: the bytes
around the text are built once per choice, so a token costs one string escape and one concatenation, not a dict and a
json.dumps. Everything one delta brings (its content and its finish chunk) goes out in one socket write.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import msgspec

from frontend.engine.fanout import Choice, FanOut
from frontend.engine.request_stream import Delta
from frontend.errors import ApiError, sse_error

_encode = msgspec.json.encode  # a str -> its JSON string literal, as json.dumps(ensure_ascii=False) spells it
CHUNK_FIELDS = "__chunk__"  # a choice's key for fields of its whole chunk, beside `choices` (token_ids.py)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class ResponseFormat(Protocol):
    """How one endpoint spells its chunks and its final response."""

    chunk_object: str

    def opening(self, index: int) -> dict[str, Any] | None: ...
    def content(self, index: int, delta: Delta) -> list[dict[str, Any]]: ...  # several where text and tool calls
    def text_affixes(self, index: int) -> tuple[str, str] | None: ...  # content(delta) = before + text + after
    def finish(self, index: int, delta: Delta) -> dict[str, Any]: ...
    def response(self, choices: list[Choice], usage: dict[str, Any]) -> dict[str, Any]: ...


class ChunkWriter:
    """One stream's chunk bytes: `data: {head, "object", "choices": [choice], "usage": null?}\\n\\n`.

    `prompt_tokens` (each choice's prompt length) asks for vLLM's continuous_usage_stats: every chunk's usage is
    its choice's so far instead of null."""

    def __init__(self, fmt: ResponseFormat, head: dict[str, Any], include_usage: bool, num_choices: int,
                 prompt_tokens: list[int] | None = None) -> None:  # fmt: skip
        self.fmt = fmt
        self.head = head
        self.include_usage = include_usage
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = [0] * num_choices  # what each choice's chunks carried so far
        start = f"data: {dumps({**head, 'object': fmt.chunk_object})[:-1]},\"choices\":["
        end = "]" + (',"usage":null' if include_usage else "") + "}\n\n"
        self.affixes: list[tuple[bytes, bytes] | None] = []
        for index in range(num_choices):
            plain = fmt.text_affixes(index) if prompt_tokens is None else None
            self.affixes.append(None if plain is None else ((start + plain[0]).encode(), (plain[1] + end).encode()))

    def chunk(self, choice: dict[str, Any]) -> bytes:
        fields = choice.pop(CHUNK_FIELDS, {})
        body = {**self.head, "object": self.fmt.chunk_object, **fields, "choices": [choice]}
        if self.prompt_tokens is not None:
            prompt, done = self.prompt_tokens[choice["index"]], self.completion_tokens[choice["index"]]
            body["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        elif self.include_usage:
            body["usage"] = None
        return f"data: {dumps(body)}\n\n".encode()

    def delta(self, index: int, delta: Delta) -> bytes:
        """The delta's content chunks (none for a delta without text) and, at the end, its finish chunk."""
        affixes = self.affixes[index]
        self.completion_tokens[index] += len(delta.token_ids)
        if affixes is not None:
            out = affixes[0] + _encode(delta.text) + affixes[1] if delta.text else b""
        else:
            out = b"".join(self.chunk(piece) for piece in self.fmt.content(index, delta))
        if delta.finish_reason is not None:
            out += self.chunk(self.fmt.finish(index, delta))
        return out

    def usage(self, usage: dict[str, int]) -> bytes:
        body = {**self.head, "object": self.fmt.chunk_object, "choices": [], "usage": usage}
        return f"data: {dumps(body)}\n\n".encode()


async def sse_stream(fan: FanOut, fmt: ResponseFormat, head: dict[str, Any], include_usage: bool,
                     continuous_usage: bool,
                     failure: Callable[[str | None, str | None], ApiError]) -> AsyncIterator[bytes]:  # fmt: skip
    """content chunks (finish_reason null) -> each choice's finish chunk -> usage chunk -> [DONE]."""
    prompt_tokens = [len(c.stream.request.prompt_token_ids) for c in fan.choices] if continuous_usage else None
    writer = ChunkWriter(fmt, head, include_usage, len(fan.choices), prompt_tokens)
    try:
        openings = [writer.chunk(o) for i in range(len(fan.choices)) if (o := fmt.opening(i)) is not None]
        if openings:
            yield b"".join(openings)
        async for index, delta in fan.deltas():
            if delta.finish_reason == "error":
                err = failure(delta.error, delta.error_code)
                yield sse_error(err.status, err.message, err.code).encode()
                break
            if out := writer.delta(index, delta):
                yield out
        else:
            yield (writer.usage(fan.usage()) if include_usage else b"") + b"data: [DONE]\n\n"
            return
        yield b"data: [DONE]\n\n"
    finally:
        fan.abort()
