"""Tool-call parsers: generated text, fed in pieces, -> content and tool-call events; the hermes and Llama 3 JSON
formats (--tool-call-parser; pythonic in pythonic_parser.py).

Every parser gives the same events however its text is split (all at once for a whole response, token by token
for a stream), so the streamed content and arguments pieces concatenate to exactly the non-streamed ones.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal, Protocol

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Content:
    text: str


@dataclass
class Reasoning:
    text: str  # a piece of a thinking model's reasoning (frontend/tools/reasoning.py)


@dataclass
class CallStart:
    index: int  # the call's position among this choice's calls
    id: str
    name: str


@dataclass
class Arguments:
    index: int
    text: str  # a piece of the call's arguments (JSON text)


Event = Content | Reasoning | CallStart | Arguments


class ToolParser(Protocol):
    calls: int  # complete calls so far

    def feed(self, text: str) -> list[Event]: ...
    def finish(self) -> list[Event]: ...


def parser_events(parser: ToolParser | None, text: str, final: bool) -> list[Event]:
    """A piece of generated text as parser events, flushed when it is the last (all content without a parser)."""
    if parser is None:
        return [Content(text)] if text else []
    events = parser.feed(text) if text else []
    return events + parser.finish() if final else events


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def no_constant(name: str) -> Any:
    """json.loads' parse_constant: NaN and Infinity are not JSON."""
    raise ValueError(f"{name} is not JSON")


def call_of(obj: Any, arguments: Any) -> tuple[str, str] | None:
    """A decoded call and its arguments -> (name, arguments as JSON text), or None when they are not a call."""
    if not isinstance(obj, dict) or not isinstance(arguments, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        (name + text).encode()  # a lone surrogate spelled as an escape is not text
    except (ValueError, TypeError, RecursionError):  # TypeError: not JSON's types (pythonic calls' sets, bytes)
        return None
    return name, text


def parse_call(text: str) -> tuple[str, str] | None:
    """{"name": ..., "arguments": {...}} (no arguments: {}) -> (name, arguments as JSON text), or None."""
    try:
        call = json.loads(text, parse_constant=no_constant)
    except (ValueError, RecursionError):
        return None
    return call_of(call, call.get("arguments", {}) if isinstance(call, dict) else None)


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (the tag may be split there)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class CallsUpTo:
    """What the parsers of the model's own format share: the calls emitted so far, and none past `max_calls`
    (parallel_tool_calls false: one)."""

    new_id = staticmethod(call_id)  # a call's id (Mistral's templates take only their own kind)

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.calls = 0

    def _call(self, name: str, arguments: str) -> list[Event]:
        """A whole call's events; none for a call past max_calls, which is dropped."""
        if self.max_calls is not None and self.calls >= self.max_calls:
            return []
        self.calls += 1
        return [CallStart(self.calls - 1, self.new_id(), name), Arguments(self.calls - 1, arguments)]


class HermesParser(CallsUpTo):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Hermes and Qwen2.5 models write calls.

    Text outside the tags is content; whitespace that only separates content from a call is dropped. A call is
    held until its closing tag (or the end of the text), then emitted whole: a malformed one stays content, exactly
    as written. A call the model ends without its closing tag still counts if its JSON is complete. Calls past
    `max_calls` (parallel_tool_calls false: one) are dropped. A format of other tags around each call (FunctionGemma's)
    changes `open_tag`, `close_tag` and `parse`.
    """

    open_tag, close_tag = OPEN, CLOSE
    parse = staticmethod(parse_call)  # the text between the tags -> (name, arguments as JSON text), or None

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.pending = ""  # content held back: trailing whitespace and what may be the start of OPEN
        self.in_call = False
        self.call_text = ""  # inside OPEN so far
        self.call_ws = ""  # the whitespace before OPEN: content again if the call turns out malformed
        self.after_call = False  # dropping whitespace after a call

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        while text:
            if self.in_call:
                text = self._in_call(text, events)
                continue
            if self.after_call:
                stripped = text.lstrip()
                if not stripped:
                    return events
                text, self.after_call = stripped, False
            buf, self.pending = self.pending + text, ""
            text = ""
            at = buf.find(self.open_tag)
            if at >= 0:
                before = buf[:at]
                body = before.rstrip()
                self._content(events, body)
                self.call_ws, self.in_call, self.call_text = before[len(body) :], True, ""
                text = buf[at + len(self.open_tag) :]
                continue
            keep = partial_tag(buf, self.open_tag)
            head = buf[: len(buf) - keep]
            body = head.rstrip()
            self._content(events, body)
            self.pending = buf[len(body) :]
        return events

    def _in_call(self, text: str, events: list[Event]) -> str:
        """Consumes call text; returns what follows the closing tag (empty while the call is open)."""
        close = self.close_tag
        start = max(0, len(self.call_text) - len(close) + 1)  # only where a new closing tag can be
        self.call_text += text
        at = self.call_text.find(close, start)
        if at < 0:
            return ""
        inner, rest = self.call_text[:at], self.call_text[at + len(close) :]
        self.in_call, self.call_text = False, ""
        self._end_call(events, inner, self.open_tag + inner + close)
        return rest

    def _end_call(self, events: list[Event], inner: str, raw: str) -> None:
        call = self.parse(inner)
        if call is None:
            self._content(events, self.call_ws + raw)
            return
        events += self._call(*call)
        self.after_call = True

    @staticmethod
    def _content(events: list[Event], text: str) -> None:
        if text:
            events.append(Content(text))

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self.in_call:
            self.in_call = False
            self._end_call(events, self.call_text, self.open_tag + self.call_text)
        elif not self.after_call:
            self._content(events, self.pending)
        self.pending = ""
        return events


PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder(parse_constant=no_constant)


class Llama3JsonParser(CallsUpTo):
    """`{"name": ..., "parameters": {...}}`, as Llama 3.1-3.3 write calls under their JSON tool prompt: the answer
    begins with the call (after whitespace and an optional <|python_tag|>), several are separated by ";", and
    "arguments" is read where there are no "parameters" (vLLM's llama3_json reads the same).

    An answer that begins otherwise is content, streamed as it comes. A call is held until its object closes, then
    emitted whole. A first object that is not a call (a name and an object of parameters) makes the whole answer
    content, exactly as written; what follows the calls is content, and so is an object cut off by the end. Calls
    past `max_calls` are dropped.
    """

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.state: Literal["start", "calls", "content"] = "start"
        self.held = ""  # start and calls: the text since the start, or since the last call

    def feed(self, text: str) -> list[Event]:
        if self.state == "content":
            return [Content(text)]
        self.held += text
        if self.state == "start":
            head = self._rest()
            if not head or PYTHON_TAG.startswith(head):  # nothing but whitespace, or maybe the tag, so far
                return []
            if not head.startswith("{"):
                return self._to_content(self.held)
            self.state = "calls"
        return self._calls(closing="}" in text)

    def _rest(self) -> str:
        """`held` without what leads to the next call: whitespace, the tag before the first, ";" between two."""
        rest = self.held.lstrip()
        lead = ";" if self.calls else PYTHON_TAG
        return rest[len(lead) :].lstrip() if rest.startswith(lead) else rest

    def _calls(self, closing: bool) -> list[Event]:
        """Emits the calls that are whole in `held`; an object can only become whole on a "}" (`closing`)."""
        events: list[Event] = []
        while rest := self._rest():
            if not rest.startswith("{"):
                return events + self._to_content(rest)
            if not closing:
                return events
            try:
                obj, end = _DECODER.raw_decode(rest)
            except (ValueError, RecursionError):
                return events  # not whole yet (or never: finish() makes it content)
            call = call_of(obj, obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None)
            if call is None:
                return events + self._to_content(rest if self.calls else self.held)
            events += self._call(*call)
            self.held = rest[end:]
        return events

    def _to_content(self, text: str) -> list[Event]:
        self.state, self.held = "content", ""
        return [Content(text)] if text else []

    def finish(self) -> list[Event]:
        if self.state == "content":
            return []
        return self._to_content(self._rest() if self.calls else self.held)
