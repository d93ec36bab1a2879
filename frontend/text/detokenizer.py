"""IncrementalDetokenizer: token ids -> text deltas in O(1) amortized work per token, with stop strings."""

from __future__ import annotations

import codecs
from typing import Protocol

from frontend.text.stop_strings import StopStringMatcher

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

    Where decoding is joining the tokens' bytes (the tokenizer's `joined_bytes`: byte-level vocabularies), each
    token's bytes go through an incremental UTF-8 decoder instead: the same text, with no decode call per token,
    which was a fifth of the API process's time at 256 streams. Trailing U+FFFD waits there too.
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
        self.matcher = StopStringMatcher(self.stop) if self.stop else None
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.pending = ""  # output text held back: it could still turn out to be the start of a stop string
        self.stop_reason: str | None = None  # the stop string that ended the text
        self.joined: list[bytes] | None = getattr(tokenizer, "joined_bytes", None)
        if self.joined is not None:
            self.skipped = getattr(tokenizer, "special_ids", frozenset()) if skip_special_tokens else frozenset()
            self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            self.invalid = ""  # trailing U+FFFD held back: dropped if the text ends there, as a window's would be

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
        self.num_tokens += 1
        if self.joined is not None:
            return self._extend(self._joined_delta(token_id), final=False)
        self.ids.append(token_id)
        return self._extend(self._window_delta(final=False), final=False)

    def _joined_delta(self, token_id: int) -> str:
        piece = b"" if token_id in self.skipped or token_id >= len(self.joined) else self.joined[token_id]
        text = self.invalid + self.utf8.decode(piece)
        shown = text.rstrip("\ufffd")
        self.invalid = text[len(shown) :]
        return shown

    def finish(self) -> str:
        """The generation ended: flush what waited for more tokens, and any held-back stop-string prefix."""
        if self.stopped:
            return ""
        # What waits is an incomplete character or U+FFFD at the very end: not text.
        delta = "" if self.joined is not None else self._window_delta(final=True) if self.read < len(self.ids) else ""
        return self._extend(delta, final=True)

    def _extend(self, delta: str, final: bool) -> str:
        # Only the text not streamed yet is kept: appending to the whole output would copy all of it every token.
        text = self.pending + delta
        if self.matcher is not None and delta:
            # Every character goes through the matcher, so its state is right once past min_tokens; as vLLM, a stop
            # string counts only if it ends in text that came with a token after the first min_tokens.
            match = self.matcher.feed(delta, check=self.num_tokens > self.min_tokens)
            if match is not None:
                # It starts in `text`, not in streamed text: what of it came before `delta` was held back as a prefix.
                end, s = match
                text = text[: len(self.pending) + end - (0 if self.include_stop else len(s))]
                self.stop_reason = s
        # The longest text suffix that could still grow into a stop string is not streamed yet; with
        # include_stop_str_in_output the text up to the stop string's end is shown anyway.
        held = self.matcher.held if self.matcher is not None and not self.include_stop else 0
        cut = len(text) if final or self.stopped else len(text) - held
        self.pending = text[cut:]
        return text[:cut]
