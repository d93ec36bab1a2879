"""Mistral's tool calls (--tool-call-parser mistral), after a [TOOL_CALLS] tag, in either of its two spellings:
- a JSON list of calls, `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Nemo, Small 3.1
  and the other models of tokenizers before v11; a single object is read as a list of one);
- `[TOOL_CALLS]name[ARGS]{...}` for each call (tokenizers v11 and later: Small 3.2, Magistral, Devstral), where a
  `[CALL_ID]id` may come before `[ARGS]`.

In Mistral's tokenizers these tags are special tokens, so a request parsed here keeps special tokens in its text
(`ToolPlan.keeps_special_tokens`), as vLLM does for this parser. Text before a tag is content; whitespace that only
separates content from calls is dropped. Calls are held until their JSON closes, then emitted whole; a tag that
does not lead to calls stays content, exactly as written, and so does a call the answer cuts off. Call ids are nine
letters and digits, the only ids Mistral's chat templates accept when the calls come back in the conversation.
"""

from __future__ import annotations

import json
import re
import secrets
import string

from frontend.tools.tool_parsers import CallsUpTo, Content, Event, call_of, no_constant, partial_tag

TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_DECODER = json.JSONDecoder(parse_constant=no_constant)
_HEADER = re.compile(r"([\w.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]\s*")  # name[CALL_ID]id[ARGS]
_NOT_IN_HEADER = re.compile(r"[\s{}]")  # what neither a name nor an id holds: the text after the tag is no header
_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


class MistralParser(CallsUpTo):
    tag = TAG  # what opens the calls (Granite's parser: another tag, the same JSON list after it)
    new_id = staticmethod(mistral_call_id)

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.held = ""  # content: trailing whitespace and what may be the start of TAG; calls: the text after TAG
        self.in_calls = False
        self.tag_ws = ""  # the whitespace before TAG: content again if no calls follow it
        self.after_calls = False  # dropping whitespace after calls
        self.closing = False

    def feed(self, text: str) -> list[Event]:
        self.held += text
        self.closing = "}" in text or "]" in text  # calls' JSON can only become whole on one of these
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self.held:
            if self.in_calls:
                if not self._calls(events, final):
                    break
                continue
            if self.after_calls:
                self.held = self.held.lstrip()
                if not self.held:
                    break
                self.after_calls = False
            at = self.held.find(self.tag)
            if at < 0:
                keep = 0 if final else partial_tag(self.held, self.tag)
                head = self.held[: len(self.held) - keep]
                body = head if final else head.rstrip()  # trailing whitespace waits: a tag may follow it
                self._content(events, body)
                self.held = self.held[len(body) :]
                break
            before = self.held[:at]
            body = before.rstrip()
            self._content(events, body)
            self.tag_ws, self.in_calls, self.held = before[len(body) :], True, self.held[at + len(self.tag) :]
        if final and self.in_calls:  # a tag at the very end
            self._not_calls(events)
        return events

    def _calls(self, events: list[Event], final: bool) -> bool:
        """Reads the calls after a tag from `held`: False while they are not whole yet (at the end: content)."""
        body = self.held.lstrip()
        lead = len(self.held) - len(body)
        if not body:
            return self._not_calls(events) if final else False
        if not (final or self.closing):
            return self._early_end(events, body)
        if body[0] in "[{":  # the JSON list of calls
            try:
                obj, end = _DECODER.raw_decode(body)
            except (ValueError, RecursionError):  # not whole yet, or never
                return self._not_calls(events) if final else False
            items = obj if isinstance(obj, list) else [obj]
            calls = [call_of(c, c.get("arguments", {}) if isinstance(c, dict) else None) for c in items]
            if not items or None in calls:
                return self._not_calls(events)
            for call in calls:
                events += self._call(*call)  # type: ignore[misc]
            return self._called(lead + end)
        header = _HEADER.match(body)
        if header is None:
            return self._not_calls(events) if final else self._early_end(events, body)
        args = body[header.end() :]
        try:
            obj, end = _DECODER.raw_decode(args)
        except (ValueError, RecursionError):
            return self._not_calls(events) if final or args[:1] not in ("", "{") else False
        call = call_of({"name": header.group(1)}, obj)
        if call is None:
            return self._not_calls(events)
        events += self._call(*call)
        return self._called(lead + header.end() + end)

    def _early_end(self, events: list[Event], body: str) -> bool:
        """Before the calls can be whole: the tag is content at once where the text after it cannot be a header
        (a space or brace before any [ARGS]) nor a JSON list, so that a plain answer after a stray tag streams."""
        if body[0] in "[{" or _HEADER.match(body):
            return False
        cut = _NOT_IN_HEADER.search(body)
        return self._not_calls(events) if cut is not None and ARGS not in body[: cut.start()] else False

    def _called(self, consumed: int) -> bool:
        self.held, self.in_calls, self.after_calls = self.held[consumed:], False, True
        return True

    def _not_calls(self, events: list[Event]) -> bool:
        """The tag leads to no calls: it is content as written, and what follows it is read as content again."""
        self._content(events, self.tag_ws + self.tag)
        self.in_calls = False
        return True

    @staticmethod
    def _content(events: list[Event], text: str) -> None:
        if text:
            events.append(Content(text))
