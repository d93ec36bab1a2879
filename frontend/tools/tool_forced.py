"""Parsers for calls forced by a schema (tool_choice "required" or a named function): the constrained output is
JSON, read character by character so the arguments stream as they are generated, exactly as written.

Named: the output is the arguments object itself. Required: an array of {"name": ..., "arguments": {...}}. Text
that does not start as that JSON (a model not held to the schema) is content.
"""

from __future__ import annotations

import json

from frontend.tools.tool_parsers import Arguments, CallStart, Content, Event, call_id

_WS = " \t\r\n"


def _string(raw: str) -> str | None:
    """A JSON string's value; None for anything else (only text not held to the schema can be that)."""
    try:
        value = json.loads(raw)
        return value if isinstance(value, str) and value.encode() else None
    except ValueError:
        return None


class JsonValue:
    """Follows one JSON value character by character and says where it ends (the input is valid JSON)."""

    def __init__(self) -> None:
        self.first = ""
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def take(self, ch: str) -> bool:
        """Whether `ch` belongs to the value; sets `done` at its last character (a scalar ends before one)."""
        if not self.first:
            self.first = ch
            self.depth = 1 if ch in "{[" else 0
            self.in_string = ch == '"'
            return True
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self.done = self.depth == 0
            return True
        if self.depth == 0:  # a number, true, false or null: ends at a delimiter
            self.done = ch in _WS or ch in ",:]}"
            return not self.done
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True


class NamedCallParser:
    """The output is the arguments of the one named function."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0
        self.lead = ""  # whitespace before the object
        self.value: JsonValue | None = None
        self.tail = ""  # after the object: only whitespace under the schema
        self.plain = False  # not an object: all content

    def feed(self, text: str) -> list[Event]:
        if self.plain:
            return [Content(text)] if text else []
        events: list[Event] = []
        if self.value is None:
            stripped = text.lstrip(_WS)
            if not stripped:
                self.lead += text
                return events
            if stripped[0] != "{":
                self.plain = True
                return [Content(self.lead + text)]
            text, self.value = stripped, JsonValue()
            events.append(CallStart(0, call_id(), self.name))
        if self.value.done:
            self.tail += text
            return events
        end = 0
        while end < len(text) and not self.value.done:
            self.value.take(text[end])
            end += 1
        events.append(Arguments(0, text[:end]))
        if self.value.done:
            self.calls, self.tail = 1, text[end:]
        return events

    def finish(self) -> list[Event]:
        if self.value is None and not self.plain and self.lead:
            return [Content(self.lead)]
        return [Content(self.tail)] if self.tail.strip(_WS) else []


class ForcedCallsParser:
    """The output is an array of calls: [{"name": "f", "arguments": {...}}, ...]. A call starts (CallStart) once
    its name is read; arguments written before the name (keys in the other order) are held until then."""

    def __init__(self) -> None:
        self.calls = 0  # complete calls
        self.started = 0  # calls whose CallStart was sent
        self.state = "start"  # start | array | object | colon | before_value | reading | end | plain
        self.lead = ""  # whitespace before the array
        self.tail = ""  # after the array: only whitespace under the schema
        self.value = JsonValue()
        self.reading = ""  # what the value being read is: "key", "name", "arguments" or "other"
        self.raw = ""  # a key's or a name's JSON text
        self.key: str | None = None
        self.index = -1  # this element's call index once started
        self.held = ""  # this element's arguments while its name is not known
        self.has_arguments = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        i = 0
        while i < len(text):
            if self.state == "plain":
                events.append(Content(text[i:]))
                break
            if self.state == "end":
                self.tail += text[i:]
                break
            if self.state == "reading":
                i = self._read(events, text, i)
                continue
            ch = text[i]
            i += 1
            if ch in _WS:
                self.lead += ch if self.state == "start" else ""
            elif self.state == "start":
                self.state = "array" if ch == "[" else "plain"
                if self.state == "plain":
                    events.append(Content(self.lead + text[i - 1 :]))
                    break
            elif self.state == "array" and ch == "{":
                self.state, self.index, self.held, self.has_arguments = "object", -1, "", False
            elif self.state == "array" and ch == "]":
                self.state = "end"
            elif self.state == "object" and ch == '"':
                self._begin("key")
                i -= 1
            elif self.state == "object" and ch == "}":
                self.calls += self.index >= 0 and self.has_arguments
                self.state = "array"
            elif self.state == "colon" and ch == ":":
                self.state = "before_value"
            elif self.state == "before_value":
                self._begin(self.key if self.key in ("name", "arguments") else "other")
                i -= 1
        return events

    def _begin(self, reading: str) -> None:
        self.state, self.reading, self.raw, self.value = "reading", reading, "", JsonValue()

    def _read(self, events: list[Event], text: str, i: int) -> int:
        """Reads the current value from text[i:]; returns where it stopped."""
        end = i
        while end < len(text) and not self.value.done:
            end += self.value.take(text[end])
        piece = text[i:end]
        if self.reading == "arguments":
            self.has_arguments = True
            if self.index >= 0:
                events.append(Arguments(self.index, piece))
            else:
                self.held += piece
        elif self.reading in ("key", "name"):
            self.raw += piece
        if not self.value.done:
            return end
        if self.reading == "key":
            self.key, self.state = _string(self.raw), "colon"
            return end
        self.state = "object"
        name = _string(self.raw) if self.reading == "name" else None
        if isinstance(name, str) and self.index < 0:
            self.index, self.started = self.started, self.started + 1
            events.append(CallStart(self.index, call_id(), name))
            if self.held:
                events.append(Arguments(self.index, self.held))
        return end

    def finish(self) -> list[Event]:
        if self.state == "start" and self.lead:
            return [Content(self.lead)]
        return [Content(self.tail)] if self.state == "end" and self.tail.strip(_WS) else []
