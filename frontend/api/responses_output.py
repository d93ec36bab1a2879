"""A response's output items, built from the parsers' events (reasoning and content text, call starts, argument
pieces): a `reasoning` item holds the model's thinking, a `message` item content, a `function_call` item each call,
in the order the model wrote them. Every step also returns the stream events OpenAI sends for it, so a streamed
response and a whole one are built by the same code."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from frontend.tools.tool_parsers import Arguments, CallStart, Content, Event, Reasoning


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class TextOut:
    """An item whose one content part grows with the text as it comes."""

    id: str
    text: str = ""
    status: str = "in_progress"


class MessageOut(TextOut):
    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": []}

    def item(self, with_content: bool = True) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "status": self.status, "role": "assistant",
                "content": [self.part()] if with_content else []}  # fmt: skip


class ReasoningOut(TextOut):
    """--reasoning-parser: the model's <think> text, as OpenAI shapes a reasoning item's content."""

    def part(self) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": self.text}

    def item(self, with_content: bool = True) -> dict[str, Any]:
        return {"id": self.id, "type": "reasoning", "status": self.status, "summary": [],
                "content": [self.part()] if with_content else []}  # fmt: skip


@dataclass
class CallOut:
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: str = "in_progress"

    def item(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function_call", "status": self.status, "call_id": self.call_id,
                "name": self.name, "arguments": self.arguments}  # fmt: skip


class OutputBuilder:
    """One response's output items. feed() and finish() return the events that describe each change (without
    sequence numbers, which the stream adds)."""

    def __init__(self) -> None:
        self.items: list[MessageOut | ReasoningOut | CallOut] = []
        self.calls: list[CallOut] = []  # by the parser's call index
        self.open: MessageOut | ReasoningOut | CallOut | None = None

    def output(self) -> list[dict[str, Any]]:
        return [i.item() for i in self.items]

    def feed(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Content):
                if e.text:
                    out += self._text(e.text)
            elif isinstance(e, Reasoning):
                if e.text:
                    out += self._reasoning(e.text)
            elif isinstance(e, CallStart):
                out += self._close("completed")
                call = CallOut(item_id("fc"), e.id, e.name)
                self.calls.append(call)
                out.append(self._opened(call, call.item()))
            elif isinstance(e, Arguments):
                call = self.calls[e.index]
                call.arguments += e.text
                out.append({"type": "response.function_call_arguments.delta", "item_id": call.id,
                            "output_index": self.items.index(call), "delta": e.text})  # fmt: skip
        return out

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Closes the last item with the response's status; a response that wrote nothing has one empty message."""
        out = [] if self.items else self._open_message()
        return out + self._close(status)

    def _opened(self, item: MessageOut | ReasoningOut | CallOut, shown: dict[str, Any]) -> dict[str, Any]:
        self.items.append(item)
        self.open = item
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": shown}

    def _open_message(self) -> list[dict[str, Any]]:
        out = self._close("completed")
        message = MessageOut(item_id("msg"))
        out.append(self._opened(message, message.item(with_content=False)))
        out.append({"type": "response.content_part.added", "item_id": message.id,
                    "output_index": len(self.items) - 1, "content_index": 0, "part": message.part()})  # fmt: skip
        return out

    def _text(self, text: str) -> list[dict[str, Any]]:
        out = [] if isinstance(self.open, MessageOut) else self._open_message()
        message = self.open
        assert isinstance(message, MessageOut)
        message.text += text
        out.append({"type": "response.output_text.delta", "item_id": message.id, "output_index": len(self.items) - 1,
                    "content_index": 0, "delta": text, "logprobs": []})  # fmt: skip
        return out

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not isinstance(self.open, ReasoningOut):
            out += self._close("completed")
            reasoning = ReasoningOut(item_id("rs"))
            out.append(self._opened(reasoning, reasoning.item(with_content=False)))
        item = self.open
        assert isinstance(item, ReasoningOut)
        item.text += text
        out.append({"type": "response.reasoning_text.delta", "item_id": item.id, "output_index": len(self.items) - 1,
                    "content_index": 0, "delta": text})  # fmt: skip
        return out

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        index = self.items.index(item)
        head = {"item_id": item.id, "output_index": index}
        if isinstance(item, MessageOut):
            events = [{"type": "response.output_text.done", **head, "content_index": 0, "text": item.text,
                       "logprobs": []},
                      {"type": "response.content_part.done", **head, "content_index": 0, "part": item.part()}]
        elif isinstance(item, ReasoningOut):
            events = [{"type": "response.reasoning_text.done", **head, "content_index": 0, "text": item.text}]
        else:
            events = [{"type": "response.function_call_arguments.done", **head, "name": item.name,
                       "arguments": item.arguments}]  # fmt: skip
        return [*events, {"type": "response.output_item.done", "output_index": index, "item": item.item()}]
