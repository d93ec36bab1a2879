"""Tool calls (and reasoning) in chat responses: parser events -> OpenAI's streamed `tool_calls` deltas, or a whole
message.

One parser per choice. A stream's first delta for a call carries index, id, type, the name and empty arguments;
the next ones carry pieces of the arguments. A choice that made a call and stopped finishes with "tool_calls".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from frontend.tools.tool_parsers import Arguments, CallStart, Content, Event, Reasoning, ToolParser, parser_events


def _deltas(events: list[Event]) -> list[dict[str, Any]]:
    """Events -> delta objects; neighbouring content, reasoning, and pieces of one call's arguments, merge."""
    out: list[dict[str, Any]] = []
    last: Event | None = None
    for e in events:
        if isinstance(e, Content | Reasoning):
            key = "content" if isinstance(e, Content) else "reasoning"
            if type(last) is type(e):
                out[-1][key] += e.text
            else:
                out.append({key: e.text})
        elif isinstance(e, CallStart):
            out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                        "function": {"name": e.name, "arguments": ""}}]})  # fmt: skip
        elif isinstance(last, Arguments) and last.index == e.index:
            out[-1]["tool_calls"][0]["function"]["arguments"] += e.text
        else:
            out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        last = e
    return out


def finish_reason(parser: ToolParser, reason: str | None) -> str | None:
    """A choice that stopped after making calls finished to call them; "length" (a cut call) stays."""
    return "tool_calls" if reason == "stop" and parser.calls else reason


def message(parser: ToolParser, text: str) -> dict[str, Any]:
    """The whole response's assistant message: content (null when there are calls and no other text), reasoning
    (when the model wrote any) and calls."""
    events = parser_events(parser, text, True)
    content = "".join(e.text for e in events if isinstance(e, Content))
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    calls: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, CallStart):
            calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        elif isinstance(e, Arguments):
            calls[e.index]["function"]["arguments"] += e.text
    out: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if reasoning:
        out["reasoning"] = reasoning
    if calls:
        out["tool_calls"] = calls
    return out


def as_function_call(delta: dict[str, Any]) -> dict[str, Any] | None:
    """A delta or message in the legacy form (request `functions`): its first call as `function_call` (name and
    arguments, or a piece of the arguments), or None for a delta of a later call, which that form cannot hold."""
    calls = delta.get("tool_calls")
    if not calls:
        return delta
    if calls[0].get("index", 0) != 0:
        return None
    out = {k: v for k, v in delta.items() if k != "tool_calls"}
    fn = calls[0]["function"]
    out["function_call"] = {"name": fn["name"], "arguments": fn["arguments"]} if "name" in fn else fn
    return out


def legacy_finish_reason(reason: str | None) -> str | None:
    return "function_call" if reason == "tool_calls" else reason


class ToolStreams:
    """The parsers of one streamed request's choices."""

    def __init__(self, make_parser: Callable[[], ToolParser]) -> None:
        self.make_parser = make_parser
        self.parsers: dict[int, ToolParser] = {}

    def parser(self, index: int) -> ToolParser:
        if index not in self.parsers:
            self.parsers[index] = self.make_parser()
        return self.parsers[index]

    def deltas(self, index: int, text: str, final: bool) -> list[dict[str, Any]]:
        """The delta objects for one engine delta's text (`final`: the choice's last, which flushes the parser)."""
        return _deltas(parser_events(self.parser(index), text, final))

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        return finish_reason(self.parser(index), reason)
