"""IncrementalDetokenizer: token ids -> text deltas in O(1) amortized work per token, with stop strings."""

from __future__ import annotations

from typing import Protocol

# Prompt tokens decoded ahead of the first output token, so tokenizers that strip a leading space
# (SentencePiece) or merge bytes across tokens decode the first output token as they would mid-text.
PROMPT_CONTEXT = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Decodes a small window of recent ids: text = decode(window) minus decode(window's already-read head).

    `prefix` and `read` are offsets into `ids`: ids[prefix:read] is context already turned into text,
    ids[read:] the tokens not yet emitted. A window that ends in an incomplete UTF-8 character decodes
    to U+FFFD at its end; we wait for the next token instead of emitting it.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        context = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self.ids = context
        self.prefix = 0
        self.read = len(context)
        self.stop = [s for s in stop or [] if s]
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.text = ""  # output text so far, including what is held back
        self.emitted = 0  # characters of `text` already returned
        self.stop_reason: str | None = None  # the stop string that ended the text

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def _window_delta(self, final: bool) -> str:
        decode = self.tokenizer.decode
        head = decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip_special)
        full = decode(self.ids[self.prefix :], skip_special_tokens=self.skip_special)
        if final:  # a character the generation stopped in the middle of is not text: drop its bytes
            full = full.rstrip("\ufffd")
        elif len(full) <= len(head) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or a multi-byte character split across tokens
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(head) :] if len(full) > len(head) else ""

    def add(self, token_id: int) -> str:
        """Feeds one output token; returns the text that may be shown now (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        self.num_tokens += 1
        return self._extend(self._window_delta(final=False), final=False)

    def finish(self) -> str:
        """The generation ended: flush what waited for more tokens, and any held-back stop-string prefix."""
        if self.stopped:
            return ""
        delta = self._window_delta(final=True) if self.read < len(self.ids) else ""
        return self._extend(delta, final=True)

    def _extend(self, delta: str, final: bool) -> str:
        old_len = len(self.text)
        self.text += delta
        if self.stop and delta and self.num_tokens >= self.min_tokens:
            self._find_stop(max(0, old_len - self.max_stop_len + 1))
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out

    def _find_stop(self, start: int) -> None:
        """Earliest stop string that ends in the new text; the text is truncated at (or after) it."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = self.text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is not None:
            pos, s = best
            self.text = self.text[: pos + len(s) if self.include_stop else pos]
            self.stop_reason = s

    def _held_back(self) -> int:
        """Length of the longest text suffix that could still grow into a stop string: never stream it yet."""
        if not self.stop or self.include_stop:
            return 0
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held
