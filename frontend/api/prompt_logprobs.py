"""Prompt logprobs in the API: the request side (which k the engine computes) and the two response shapes.

OpenAI's legacy completions report them with `echo` + `logprobs: n` as the leading part of `choices[i].logprobs`
(the first token null); vLLM's extension `prompt_logprobs: k` adds `prompt_logprobs` per choice on completions and
once, at the top level, on chat (as vLLM's responses): None for the first token, then {token id: {logprob, rank,
decoded_token}} holding the prompt token and the top-k. The engine sends them once, with each request's first output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from common.messages import Logprobs, SamplingParams
from frontend.api.serving import clamp
from frontend.engine.fanout import Choice
from frontend.errors import bad_request
from frontend.text.tokenizer import Tokenizer


def with_prompt_logprobs(params: SamplingParams, *wanted: int | None) -> SamplingParams:
    """params asking the engine for the largest k any part of the response needs (None: none does)."""
    asked = [k for k in wanted if k is not None]
    if not asked:
        return params
    return msgspec.structs.replace(params, prompt_logprobs=max(asked))


def check_stream(prompt_logprobs: int | None, stream: bool | None) -> None:
    # As vLLM: they come whole with the first output, and a chunk has no place for them.
    if prompt_logprobs is not None and stream:
        raise bad_request("prompt_logprobs is not available with stream=true", "prompt_logprobs")


def echo_part(name: Callable[[int], str], prompt: list[int], lp: Logprobs | None, n: int) -> dict[str, list]:
    """The prompt's share of legacy completion logprobs: tokens, token_logprobs, top_logprobs (text_offset is
    the caller's: it runs on into the generated part)."""
    rest = len(prompt) - 1
    own: list[float | None] = [None] * rest
    top: list[dict[str, float] | None] = [None] * rest
    if lp is not None and len(lp.token_logprobs) == rest:
        own = [clamp(x) for x in lp.token_logprobs]
        top = [legacy_top(name, token, x, ids[:n], vals[:n])
               for token, x, ids, vals in zip(prompt[1:], lp.token_logprobs, lp.top_ids, lp.top_logprobs,
                                               strict=False)]  # fmt: skip
    return {"tokens": [name(t) for t in prompt], "token_logprobs": [None, *own], "top_logprobs": [None, *top]}


def legacy_top(name: Callable[[int], str], token: int, logprob: float, ids: list[int],
               vals: list[float]) -> dict[str, float]:  # fmt: skip
    """One position's legacy `top_logprobs`: the chosen token first, then the top n, as vLLM; OpenAI: "the API will
    always return the logprob of the sampled token, so there may be up to logprobs+1 elements" (logprobs 0: one)."""
    top = {name(token): clamp(logprob)}
    for t, v in zip(ids, vals, strict=False):
        top.setdefault(name(t), clamp(v))
    return top


def vllm_shape(tok: Tokenizer, prompt: list[int], lp: Logprobs | None, k: int) -> list[dict[str, Any] | None]:
    entries: list[dict[str, Any] | None] = [None]
    if lp is None:
        return entries + [None] * (len(prompt) - 1)
    for i, token in enumerate(prompt[1:]):
        ids = lp.top_ids[i][:k] if i < len(lp.top_ids) else []
        vals = lp.top_logprobs[i][:k] if i < len(lp.top_logprobs) else []
        entry = {str(t): {"logprob": clamp(v), "rank": r, "decoded_token": tok.token_text(t)}
                 for r, (t, v) in enumerate(zip(ids, vals, strict=False), start=1)}  # fmt: skip
        if str(token) not in entry:  # the prompt token itself, at its own rank
            rank = lp.ranks[i] if i < len(lp.ranks) else len(ids) + 1
            entry = {str(token): {"logprob": clamp(lp.token_logprobs[i]), "rank": rank,
                                  "decoded_token": tok.token_text(token)}, **entry}  # fmt: skip
        entries.append(entry)
    return entries


def choice_prompt_logprobs(tok: Tokenizer, choice: Choice, k: int) -> list[dict[str, Any] | None]:
    return vllm_shape(tok, choice.stream.request.prompt_token_ids, choice.result.prompt_logprobs, k)


def attach_vllm_shape(tok: Tokenizer, out: list[dict[str, Any]], choices: list[Choice], k: int | None) -> None:
    """Adds each completion choice's `prompt_logprobs` (vLLM's shape), when they were asked for."""
    if k is None:
        return
    for body, c in zip(out, choices, strict=True):
        body["prompt_logprobs"] = choice_prompt_logprobs(tok, c, k)
