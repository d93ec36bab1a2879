"""FunctionGemma's tool calls (--tool-call-parser functiongemma: google/functiongemma-270m-it, a Gemma 3 270M tuned
for function calling): `<start_function_call>call:name{key:value,...}<end_function_call>` for each call. A string
value is held between two <escape> tokens (so it may hold braces, commas and quotes); objects are `{key:value,...}`,
arrays `[value,...]`, and numbers, true, false and null are written bare.

Its tags are special tokens, so a request parsed here keeps special tokens in its text, and stops at
<start_function_response>, where the model would go on to imagine the function's answer (Google names it an extra
stop sequence) (`ToolPlan`). Calls are held until their closing tag and emitted whole, as hermes calls are
(`HermesParser`); a call that does not read as one stays content, exactly as written. vLLM's parser of this name
reads string values only; this one reads every value the format writes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from frontend.tools.tool_parsers import HermesParser, call_of, no_constant

OPEN, CLOSE, ESCAPE = "<start_function_call>", "<end_function_call>", "<escape>"
STOP = "<start_function_response>"
_HEAD = re.compile(r"\s*call:([\w.\-]+)\s*(?=\{)")
_KEY = re.compile(r"\s*([^\s:{}\[\],]+)\s*:")
_BARE = re.compile(r"[^,{}\[\]]*")  # a bare value runs to the next separator
_MAX_DEPTH = 64


class _Reader:
    """A recursive reader of the format's values over `text` from position `at`; ValueError where it is not one."""

    def __init__(self, text: str, at: int) -> None:
        self.text, self.at = text, at

    def value(self, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise ValueError("nested too deep")
        self._skip_space()
        if self.text.startswith(ESCAPE, self.at):
            start = self.at + len(ESCAPE)
            end = self.text.find(ESCAPE, start)
            if end < 0:
                raise ValueError("a string without its closing <escape>")
            self.at = end + len(ESCAPE)
            return self.text[start:end]
        if self._take("{"):
            return self._items("}", depth, keyed=True)
        if self._take("["):
            return self._items("]", depth, keyed=False)
        match = _BARE.match(self.text, self.at)
        assert match is not None  # the pattern matches the empty string
        word = match.group().strip()
        self.at = match.end()
        if not word:
            raise ValueError("a missing value")
        try:
            return json.loads(word, parse_constant=no_constant)  # numbers, true, false, null
        except ValueError:
            return word  # a bare word the model did not escape: its text

    def _items(self, close: str, depth: int, keyed: bool) -> dict[str, Any] | list[Any]:
        items: dict[str, Any] = {}
        values: list[Any] = []
        if self._take(close):
            return items if keyed else values
        while True:
            if keyed:
                key = _KEY.match(self.text, self.at)
                if key is None:
                    raise ValueError("a key without its colon")
                self.at = key.end()
                items[key.group(1)] = self.value(depth + 1)
            else:
                values.append(self.value(depth + 1))
            if self._take(close):
                return items if keyed else values
            if not self._take(","):
                raise ValueError(f"no ',' or {close!r}")

    def _take(self, char: str) -> bool:
        self._skip_space()
        if self.text.startswith(char, self.at):
            self.at += 1
            return True
        return False

    def _skip_space(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1


def parse_functiongemma_call(inner: str) -> tuple[str, str] | None:
    """`call:name{...}` -> (name, arguments as JSON text), or None when it is not one whole call."""
    head = _HEAD.match(inner)
    if head is None:
        return None
    reader = _Reader(inner, head.end())
    try:
        arguments = reader.value()
    except (ValueError, RecursionError):
        return None
    if inner[reader.at :].strip():
        return None
    return call_of({"name": head.group(1)}, arguments)


class FunctionGemmaParser(HermesParser):
    open_tag, close_tag = OPEN, CLOSE
    parse = staticmethod(parse_functiongemma_call)
