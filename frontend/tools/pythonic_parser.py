"""--tool-call-parser pythonic: calls written as a Python list, `[get_weather(city="Paris", days=3), get_time()]`, as
Llama 3.2 (under vLLM's pythonic template) and Llama 4 write them, read as vLLM's parser of that name reads them.

The text is parsed with `ast`, never run: keyword arguments only, each a literal (strings, numbers, booleans, None,
and lists and dicts of them).
"""

from __future__ import annotations

import ast
from typing import Literal

from frontend.tools.tool_parsers import CallsUpTo, Content, Event, call_of


def _expression(source: str) -> ast.expr | None:
    try:
        return ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _calls(tree: ast.expr) -> list[tuple[str, str]] | None:
    """The calls a Python list makes, as (name, arguments as JSON text); None when it is not a list of calls."""
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:  # a keyword's value a literal; no **kwargs (arg None)
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        call = call_of({"name": node.func.id}, arguments) if len(arguments) == len(node.keywords) else None
        if call is None:  # also: a value JSON cannot hold (a set, bytes, an infinity)
            return None
        calls.append(call)
    return calls


class PythonicParser(CallsUpTo):
    """An answer that begins with "[" (after whitespace) is held until a "]" closes a Python list of calls; then the
    calls are emitted whole and what follows is content. Anything else is content, exactly as written: an answer that
    begins otherwise (streamed as it comes), a list that is not all calls, a list the end cuts off. Calls past
    `max_calls` are dropped."""

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.state: Literal["start", "list", "after", "content"] = "start"
        self.held = ""  # start and list: the answer so far

    def feed(self, text: str) -> list[Event]:
        if self.state == "start":
            self.held += text
            head = self.held.lstrip()
            if not head:
                return []
            if not head.startswith("["):
                return self._to_content(self.held)
            self.state, text, self.held = "list", self.held, ""
        if self.state == "list":
            return self._list(text)
        if self.state == "after":  # the whitespace between the calls and the content is dropped
            text = text.lstrip()
            if not text:
                return []
            self.state = "content"
        return [Content(text)] if text else []

    def _list(self, text: str) -> list[Event]:
        """The first "]" at which the answer so far parses as a Python expression decides it."""
        start = len(self.held)
        self.held += text
        at = self.held.find("]", start)
        while at >= 0:
            tree = _expression(self.held[: at + 1].lstrip())
            if tree is None:
                at = self.held.find("]", at + 1)
                continue
            calls, rest = _calls(tree), self.held[at + 1 :]
            if calls is None:
                return self._to_content(self.held)
            events = [e for call in calls for e in self._call(*call)]
            self.state, self.held = "after", ""
            return events + self.feed(rest)
        return []

    def _to_content(self, text: str) -> list[Event]:
        self.state, self.held = "content", ""
        return [Content(text)] if text else []

    def finish(self) -> list[Event]:
        return self._to_content(self.held) if self.state in ("start", "list") else []
