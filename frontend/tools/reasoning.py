"""Reasoning in chat answers (--reasoning-parser): what a thinking model writes inside <think>...</think> comes back
as `reasoning` beside the content, as vLLM answers; the content after it goes on to the tool-call parser, if any.

Two rules, as vLLM's parsers of those names:
- qwen3 (Qwen3's hybrid models): an answer that begins with <think> thinks until </think>; one that does not (its
  thinking turned off with `chat_template_kwargs: {"enable_thinking": false}`) is all content.
- deepseek_r1 (DeepSeek-R1 and its distills, QwQ, Qwen3's Thinking models, whose templates open the <think> in the
  prompt): the answer thinks until </think>, a leading <think> dropped; without one it is all reasoning.

Like the tool-call parsers, it gives the same events however the text is split. Whitespace between </think> and the
content is dropped.

A constrained answer (a response format, a forced call) thinks freely too, as in vLLM: the grammar holds what
follows </think> (`after_thinking`), where the tags are tokens of their own, as in the models these rules are for.
There too, usage counts the thinking's tokens (`ReasoningTokens`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import msgspec

from common.messages import StructuredOutput
from frontend.tools.tool_parsers import Event, Reasoning, ToolParser, parser_events, partial_tag

if TYPE_CHECKING:
    from frontend.text.tokenizer import Tokenizer

START, END = "<think>", "</think>"


class ReasoningParser:
    """The answer's reasoning as Reasoning events, then its content through `inner` (plain content without one)."""

    def __init__(self, rule: str, inner: ToolParser | None) -> None:
        self.rule, self.inner = rule, inner
        self.state: Literal["start", "reasoning", "after", "content"] = "start"
        self.held = ""  # start: the answer so far; reasoning: what may be the start of END

    @property
    def calls(self) -> int:
        return self.inner.calls if self.inner is not None else 0

    def feed(self, text: str) -> list[Event]:
        if self.state == "start":
            self.held += text
            head = self.held.lstrip()
            if START.startswith(head) and head != START:  # nothing but whitespace, or maybe the tag, so far
                return []
            if head.startswith(START):
                self.state, text = "reasoning", head[len(START) :]
            else:
                self.state, text = "content" if self.rule == "qwen3" else "reasoning", self.held
            self.held = ""
        if self.state == "reasoning":
            return self._reasoning(text)
        return self._content(text, final=False)

    def _reasoning(self, text: str) -> list[Event]:
        buf, self.held = self.held + text, ""
        at = buf.find(END)
        if at < 0:
            keep = partial_tag(buf, END)
            self.held = buf[len(buf) - keep :]
            return [Reasoning(buf[: len(buf) - keep])] if len(buf) > keep else []
        self.state = "after"
        return ([Reasoning(buf[:at])] if at else []) + self._content(buf[at + len(END) :], final=False)

    def _content(self, text: str, final: bool) -> list[Event]:
        if self.state == "after":  # the whitespace between </think> and the content is dropped
            text = text.lstrip()
            if not text and not final:
                return []
            self.state = "content"
        return parser_events(self.inner, text, final)

    def finish(self) -> list[Event]:
        text, self.held = self.held, ""
        if self.state == "start":  # only whitespace, or a cut <think>: as if the answer went on without one
            self.state = "content" if self.rule == "qwen3" else "reasoning"
        if self.state == "reasoning":  # (or cut off while thinking)
            return [Reasoning(text)] if text else []
        return self._content(text, final=True)


def thinking_tokens(rule: str | None, tokenizer: Tokenizer) -> tuple[int | None, int] | None:
    """The tokens a grammar waits on (StructuredOutput.reasoning_start, reasoning_end): </think>, and for qwen3,
    whose thinking is optional, <think>. None where a tag is not one token of its own: a grammar then holds the whole
    answer, which is not split."""
    if rule is None:
        return None
    start, end = tokenizer.single_token(START), tokenizer.single_token(END)
    if end is None or (rule == "qwen3" and start is None):
        return None
    return start if rule == "qwen3" else None, end


class ReasoningTokens:
    """usage.completion_tokens_details.reasoning_tokens as vLLM counts them: an answer's tokens between <think> and
    </think>, the tags left out, by the rules above. Counted on the token ids, so only where </think> (and for qwen3,
    whose thinking is optional, <think>) is one token of its own: `of` gives None elsewhere."""

    def __init__(self, rule: str, start: int | None, end: int, tokenizer: Tokenizer) -> None:
        self.rule, self.start, self.end, self.tokenizer = rule, start, end, tokenizer

    @classmethod
    def of(cls, rule: str | None, tokenizer: Tokenizer) -> ReasoningTokens | None:
        thinking = thinking_tokens(rule, tokenizer)
        if rule is None or thinking is None:
            return None
        return cls(rule, tokenizer.single_token(START), thinking[1], tokenizer)

    def __call__(self, ids: list[int]) -> int:
        first = self._after_start(ids)
        if first is None:  # no leading <think>: qwen3's answer is all content, deepseek_r1's thinks from the start
            if self.rule == "qwen3":
                return 0
            first = 0
        try:
            return ids.index(self.end, first) - first
        except ValueError:  # cut off while thinking: all of it
            return len(ids) - first

    def _after_start(self, ids: list[int]) -> int | None:
        """Where the thinking begins after a leading <think> (whitespace before it allowed, as the parser does)."""
        if self.start is None or self.start not in ids:
            return None
        at = ids.index(self.start)
        return at + 1 if not self.tokenizer.decode(ids[:at], skip_special_tokens=False).strip() else None


def after_thinking(structured: StructuredOutput, thinking: tuple[int | None, int] | None) -> StructuredOutput:
    """The constraint, held only after the thinking (`thinking_tokens`), where there are tokens to wait on."""
    if thinking is None:
        return structured
    return msgspec.structs.replace(structured, reasoning_start=thinking[0], reasoning_end=thinking[1])


def with_reasoning(rule: str | None, make_parser: Callable[[], ToolParser] | None,
                   structured: StructuredOutput | None) -> Callable[[], ToolParser] | None:  # fmt: skip
    """A choice's parser factory with the reasoning split in front of `make_parser`'s; unchanged without a rule, or
    when a grammar holds the answer from its first token (there is no thinking then, only the constrained text)."""
    if rule is None or (structured is not None and structured.reasoning_end is None):
        return make_parser
    return lambda: ReasoningParser(rule, make_parser() if make_parser is not None else None)
