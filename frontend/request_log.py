"""vLLM's request logs, at INFO, off by default (prompts and outputs are users' data); texts and token ids are cut at
--max-log-len. --enable-log-requests: a line for each request an engine core is sent, with its engine id, the engine
it went to, its prompt as text and token ids, the sampling parameters it sets (those left at their defaults are not
shown) and its LoRA adapter. --enable-log-outputs: a line for each as it ends, with its output as text and token ids
and why it ended."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from common.messages import EngineRequest, SamplingParams

if TYPE_CHECKING:
    from frontend.engine.request_stream import RequestStream

log = logging.getLogger("roseinfer.requests")
_DEFAULTS = SamplingParams()


def changed_params(params: SamplingParams) -> str:
    """`max_tokens=32, temperature=0.0`: the fields that differ from the defaults, in their declared order."""
    fields = msgspec.structs.fields(SamplingParams)
    changed = [f"{f.name}={getattr(params, f.name)!r}" for f in fields
               if getattr(params, f.name) != getattr(_DEFAULTS, f.name)]  # fmt: skip
    return ", ".join(changed) or "all defaults"


class RequestLog:
    def __init__(self, decode: Callable[[list[int]], str], max_len: int | None = None) -> None:
        """`decode`: token ids to text, special tokens kept (the text as the model sees it)."""
        self.decode = decode
        self.max_len = max_len

    def __call__(self, request: EngineRequest, engine: int) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        text, shown, more = self._cut(request.prompt_token_ids)
        lora = request.lora.name if request.lora is not None else None
        log.info("received request %s (engine %d): prompt: %r, prompt_token_ids: %s%s, params: %s, lora: %s",
                 request.request_id, engine, text, shown, more, changed_params(request.params), lora)  # fmt: skip

    def output(self, stream: RequestStream) -> None:
        """The line of a request that ended (RequestStream.on_finish)."""
        if not log.isEnabledFor(logging.INFO):
            return
        text, shown, more = self._cut(stream.output_token_ids)
        why = stream.finish_reason if stream.error is None else f"{stream.finish_reason} ({stream.error})"
        log.info("finished request %s: output: %r, output_token_ids: %s%s, finish_reason: %s", stream.request_id,
                 text, shown, more, why)  # fmt: skip

    def _cut(self, ids: list[int]) -> tuple[str, list[int], str]:
        """The text and ids shown (at most max_len of each), and what says how many more there were."""
        shown = ids if self.max_len is None else ids[: self.max_len]
        text = self.decode(shown)
        if self.max_len is not None:
            text = text[: self.max_len]
        return text, shown, "" if len(shown) == len(ids) else f" ... ({len(ids)} in all)"
