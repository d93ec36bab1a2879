"""N-gram speculative decoding (prompt lookup): drafts copied from a request's own tokens, verified in one step.

When the last n tokens of a request occurred earlier in its prompt or output, the tokens that followed them there
are a guess at what comes next. The scheduler appends up to k such draft tokens to a decode; the runner runs them
as k + 1 decode rows of the same sequence (row j attends to the keys up to its own position, the drafts' K/V
written first), and samples every row as it would sample that position alone. A row's token is kept while every
draft before it matched the token sampled there: the first row that disagrees gives the token the model chose
instead, and if all drafts match the last row gives one more. So each kept token is exactly the token decoding one
at a time would have produced (greedy, or a seeded draw, which depends only on its position; an unseeded draw
has the same distribution), and a step yields 1 to k + 1 tokens for about the cost of one while the weights, not
the arithmetic, bound it.

Requests whose next token depends on the tokens before it in ways the sampler computes per request (penalties,
`logit_bias`, `allowed_token_ids`, `bad_words`, `min_tokens`, grammars), or whose prompt logprobs are still to
come, decode one token at a time. A step's running requests plus its draft rows stay within `max_rows_per_step`,
the rows a step takes for about the price of one.
"""

from __future__ import annotations

from common.config import SpeculativeConfig
from common.messages import Logprobs
from engine_core.request import Request
from engine_core.sampler import needs_processing


class NgramIndex:
    """For each n: the n-gram ending just before position t -> t, for the latest t seen. Only n-grams with a
    following token are indexed, so the request's trailing n-gram never matches itself."""

    __slots__ = ("by_size", "num_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.by_size: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(max_n, min_n - 1, -1)}
        self.num_indexed = 0  # tokens whose preceding n-grams are indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest trailing n-gram."""
        for t in range(max(self.num_indexed, 1), len(tokens)):
            for n, index in self.by_size.items():
                if t >= n:
                    index[tuple(tokens[t - n : t])] = t
        self.num_indexed = len(tokens)
        for n, index in self.by_size.items():  # longest first
            start = index.get(tuple(tokens[-n:])) if len(tokens) >= n else None
            if start is not None:
                return tokens[start : start + k]
        return []


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.num_draft_tokens = self.num_accepted_tokens = 0  # for stats
        self.rows_left = 0  # draft rows this step may still take

    @staticmethod
    def build(spec: str | None, max_model_len: int) -> Speculator | None:
        """From --speculative-config; None when it is off. ValueError for a config we cannot run."""
        config = SpeculativeConfig.parse(spec)
        return None if config is None else Speculator(config, max_model_len)

    @staticmethod
    def takes(req: Request) -> bool:
        """Whether a request's rows can be sampled as if alone: no logits processor of the sampler's (they read the
        tokens before a row), and no prompt logprobs still to score."""
        return not needs_processing(req.params) and req.prompt_logprobs is None

    def start_step(self, num_running: int) -> None:
        """Drafts are rows beyond the batch's own: only as many as keep the step within max_rows_per_step (none
        above disable_by_batch_size running requests)."""
        limit = self.config.disable_by_batch_size
        self.rows_left = 0 if limit is not None and num_running > limit else self.config.max_rows_per_step - num_running

    def draft(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a decode of `req` this step; none beside its last prompt token, which runs as prefill
        (Request.decoding)."""
        if not self.takes(req) or not req.decoding:
            return []
        # Every kept token must fit the request's limits, the step's token budget and its rows.
        k = min(self.config.num_speculative_tokens, budget - 1, self.max_model_len - req.num_tokens,
                req.params.max_tokens - req.num_output_tokens - 1, self.rows_left)  # fmt: skip
        if k <= 0:
            return []
        if req.ngram_index is None:
            req.ngram_index = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        drafts = req.ngram_index.propose(req.token_ids, k)
        self.rows_left -= len(drafts)
        return drafts

    def count(self, drafts: list[int], kept: list[int]) -> None:
        if drafts:
            accepted = next((i for i, (d, t) in enumerate(zip(drafts, kept, strict=False)) if d != t), len(kept))
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += min(accepted, len(drafts))


def merge_logprobs(parts: list[Logprobs | None]) -> Logprobs | None:
    """One Logprobs over several kept tokens (each row's holds one)."""
    if not parts or parts[0] is None:
        return None
    merged = Logprobs([], [], [])
    for part in parts:
        assert part is not None
        merged.token_logprobs += part.token_logprobs
        merged.top_ids += part.top_ids
        merged.top_logprobs += part.top_logprobs
    return merged
