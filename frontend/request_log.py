"""--enable-log-requests (vLLM's flag): one INFO line for each request an engine core is sent, with its engine id, the
engine it went to, its prompt as text and token ids (each cut at --max-log-len), the sampling parameters it sets
(those left at their defaults are not shown) and its LoRA adapter. Off by default: prompts are users' data."""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from common.messages import EngineRequest, SamplingParams

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
        """`decode`: token ids to text, special tokens kept (the prompt as the model sees it)."""
        self.decode = decode
        self.max_len = max_len

    def __call__(self, request: EngineRequest, engine: int) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        ids = request.prompt_token_ids
        shown = ids if self.max_len is None else ids[: self.max_len]
        text = self.decode(shown)
        if self.max_len is not None:
            text = text[: self.max_len]
        more = "" if len(shown) == len(ids) else f" ... ({len(ids)} in all)"
        lora = request.lora.name if request.lora is not None else None
        log.info("received request %s (engine %d): prompt: %r, prompt_token_ids: %s%s, params: %s, lora: %s",
                 request.request_id, engine, text, shown, more, changed_params(request.params), lora)  # fmt: skip
