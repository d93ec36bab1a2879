"""The engine's own check of every request it receives: the frontend validates too, but no value that reaches the
engine may get to a tensor build (an int64 overflow) or the sampler's math (inf / NaN rows)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from common.config import DEFAULT_MAX_LOGPROBS
from common.messages import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_TOP_K,
    EngineRequest,
    SamplingParams,
)

MAX_STOP_TOKEN_IDS = 64
MAX_CACHE_SALT = 1024  # characters (the API takes 256)
# vLLM's (0, 2], floored: logits are divided by it, and below this a float32 row overflows to inf
# (1e-300 is 0.0 in float32), which turns sampling and logprobs into NaN.
MIN_REPETITION_PENALTY = 1e-6


def invalid_request(msg: EngineRequest, vocab_size: int, max_model_len: int, running: dict, pooling: bool = False,
                    max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> str | None:  # fmt: skip
    """Why the engine refuses this request, or None. pooling: the engine serves pooling requests (embeddings,
    classifier scores), and only those. max_logprobs: --max-logprobs, resolved (EngineConfig.logprobs_limit)."""

    def in_vocab(ids: Iterable[int]) -> bool:
        return all(0 <= t < vocab_size for t in ids)

    total = len(msg.prompt_token_ids) + len(msg.output_token_ids)
    if not msg.prompt_token_ids:
        return "prompt is empty"
    if not in_vocab(msg.prompt_token_ids) or not in_vocab(msg.output_token_ids):
        return f"token id outside the vocabulary [0, {vocab_size})"
    if msg.pool != pooling:
        return ("this engine serves embeddings and scores only (--runner pooling)" if pooling else
                "embeddings and scores need an engine started with --runner pooling")  # fmt: skip
    if msg.pool and (msg.params.max_tokens != 0 or msg.params.prompt_logprobs is not None or msg.output_token_ids):
        return "a pooling request generates nothing: max_tokens 0, no prompt logprobs"
    if total > max_model_len or (total == max_model_len and not msg.pool):  # a pooled prompt needs no room after it
        return f"prompt has {total} tokens; the maximum context length is {max_model_len}"
    if len(msg.eos_token_ids) > MAX_STOP_TOKEN_IDS or not in_vocab(msg.eos_token_ids):
        return "eos_token_ids out of range"
    if bad := [name for name, ok in _param_checks(msg.params, vocab_size, in_vocab, max_logprobs) if not ok]:
        return f"sampling parameter {bad[0]} out of range"
    if len(msg.cache_salt) > MAX_CACHE_SALT:
        return "cache_salt too long"
    if msg.request_id in running:
        return f"request id {msg.request_id!r} is already running"
    return None


def _param_checks(p: SamplingParams, vocab_size: int, in_vocab, max_logprobs: int) -> list[tuple[str, bool]]:
    """Every field, again. NaN fails every comparison."""
    bias = p.logit_bias
    bias_ok = len(bias) <= MAX_LOGIT_BIAS and in_vocab(bias) and all(-100 <= b <= 100 for b in bias.values())
    so = p.structured
    thinking = [t for t in (so.reasoning_start, so.reasoning_end) if t is not None] if so is not None else []
    return [
        ("max_tokens", p.max_tokens >= 0),  # 0: score the prompt (prompt_logprobs), generate nothing
        ("min_tokens", p.min_tokens >= 0),
        ("temperature", math.isfinite(p.temperature) and p.temperature >= 0),
        ("top_p", 0 < p.top_p <= 1),
        ("top_k", 0 <= p.top_k <= MAX_TOP_K),
        ("min_p", 0 <= p.min_p <= 1),
        ("presence_penalty", -2 <= p.presence_penalty <= 2),
        ("frequency_penalty", -2 <= p.frequency_penalty <= 2),
        ("repetition_penalty", MIN_REPETITION_PENALTY <= p.repetition_penalty <= 2),
        ("seed", p.seed is None or -(2**63) <= p.seed < 2**63),
        ("stop_token_ids", len(p.stop_token_ids) <= MAX_STOP_TOKEN_IDS and in_vocab(p.stop_token_ids)),
        ("logprobs", all(n is None or 0 <= n <= max_logprobs for n in (p.logprobs, p.prompt_logprobs))),
        ("logit_bias", bias_ok),
        ("allowed_token_ids", len(p.allowed_token_ids) <= vocab_size and in_vocab(p.allowed_token_ids)),
        ("bad_words", len(p.bad_words) <= 2 * MAX_BAD_WORDS and all(
            0 < len(w) <= MAX_BAD_WORD_TOKENS and in_vocab(w) for w in p.bad_words)),
        ("structured", in_vocab(thinking)),  # the reasoning tokens
    ]
