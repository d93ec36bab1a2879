"""A Messages API answer's content blocks, built from the parsers' events (reasoning and content text, call starts,
argument pieces): a `thinking` block holds the model's thinking, a `text` block content, a `tool_use` block each
call, in the order the model wrote them. Every step also returns the stream events Anthropic sends for it
(content_block_start, _delta, _stop), so a streamed answer and a whole one are built by the same code."""

from __future__ import annotations

import json
from typing import Any

from frontend.tools.tool_parsers import Arguments, CallStart, Content, Event, Reasoning


class ContentBuilder:
    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.arguments: dict[int, str] = {}  # a tool_use block's input as JSON text, by block index
        self.calls: list[int] = []  # each call's block index, by the parser's call index
        self.open: int | None = None

    def content(self) -> list[dict[str, Any]]:
        out = []
        for i, block in enumerate(self.blocks):
            if block["type"] == "tool_use":
                block = {**block, "input": _object(self.arguments[i])}
            out.append(block)
        return out

    def feed(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Content | Reasoning) and e.text:
                kind, field = ("text", "text") if isinstance(e, Content) else ("thinking", "thinking")
                if self.open is None or self.blocks[self.open]["type"] != kind:
                    start = {"type": kind, field: ""}
                    out += self._start({**start, "signature": ""} if kind == "thinking" else start)
                self.blocks[self.open][field] += e.text  # type: ignore[index]
                out.append(self._delta({"type": f"{kind}_delta", field: e.text}))
            elif isinstance(e, CallStart):
                out += self._start({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
                self.calls.append(len(self.blocks) - 1)
                self.arguments[len(self.blocks) - 1] = ""
            elif isinstance(e, Arguments):
                index = self.calls[e.index]
                self.arguments[index] += e.text
                out.append({"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": e.text}})  # fmt: skip
        return out

    def finish(self) -> list[dict[str, Any]]:
        """Closes the last block; an answer that wrote nothing has no blocks, as Anthropic's may."""
        return self._close()

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.blocks.append(block)
        self.open = len(self.blocks) - 1
        return [*out, {"type": "content_block_start", "index": self.open, "content_block": dict(block)}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.open, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        index, self.open = self.open, None
        return [] if index is None else [{"type": "content_block_stop", "index": index}]


def _object(arguments: str) -> dict[str, Any]:
    """A call's input: its JSON arguments (an object, as the tool parsers and forcing grammars give them)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
