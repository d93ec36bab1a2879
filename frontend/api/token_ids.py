"""vLLM's `return_token_ids`: the token ids behind a completion's text, for clients that train on or score exactly
what the model saw and wrote (RL rollouts, evaluation harnesses) without tokenizing the text again.

Each choice gets `token_ids`, the ids its text came from, a stop token included (it has no text), and the prompt's
ids come once: `prompt_token_ids` on each completion choice, or at the top of a chat response. Streamed, every
chunk of a choice carries the ids of its piece of text (ids that brought no text yet ride on its next chunk), and
the prompt's ids come with the choice's first chunk (chat: the stream's first chunk, beside `choices`).
"""

from __future__ import annotations

from typing import Any

from frontend.api.sse import CHUNK_FIELDS, ResponseFormat
from frontend.engine.fanout import Choice, FanOut
from frontend.engine.request_stream import Delta


class WithTokenIds:
    """Another endpoint's ResponseFormat with the token ids added; `chat`: the prompt's ids at the top."""

    def __init__(self, fmt: ResponseFormat, fan: FanOut, chat: bool) -> None:
        self.fmt = fmt
        self.chunk_object = fmt.chunk_object
        self.chat = chat
        self.prompts = [c.stream.request.prompt_token_ids for c in fan.choices]
        self.pending: list[list[int]] = [[] for _ in fan.choices]  # ids whose text has not gone out yet
        self.prompt_sent = [False] * len(fan.choices)

    def _with_ids(self, index: int, piece: dict[str, Any]) -> dict[str, Any]:
        piece["token_ids"], self.pending[index] = self.pending[index], []
        if self.chat and not any(self.prompt_sent):  # once per stream
            piece[CHUNK_FIELDS] = {"prompt_token_ids": self.prompts[index]}
        elif not self.chat and not self.prompt_sent[index]:
            piece["prompt_token_ids"] = self.prompts[index]
        self.prompt_sent[index] = True
        return piece

    def opening(self, index: int) -> dict[str, Any] | None:
        piece = self.fmt.opening(index)
        return None if piece is None else self._with_ids(index, piece)

    def content(self, index: int, delta: Delta) -> list[dict[str, Any]]:
        self.pending[index] += delta.token_ids
        pieces = self.fmt.content(index, delta)
        return [self._with_ids(index, p) for p in pieces]

    def text_affixes(self, index: int) -> tuple[str, str] | None:
        return None  # every chunk carries its ids: content() builds them all

    def finish(self, index: int, delta: Delta) -> dict[str, Any]:
        return self._with_ids(index, self.fmt.finish(index, delta))

    def response(self, choices: list[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        body = self.fmt.response(choices, usage)
        for out, c in zip(body["choices"], choices, strict=True):
            out["token_ids"] = c.result.token_ids
            if not self.chat:
                out["prompt_token_ids"] = self.prompts[c.index]
        if self.chat:
            body["prompt_token_ids"] = self.prompts[0]
        return body
