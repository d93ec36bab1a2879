"""Prompt logprobs: each prompt token's logprob under the model (and the top-k alternatives), computed during
prefill from the hidden states of the prompt positions, and sent once with the request's first output.

Position p's logits predict token p + 1, so a prompt of P tokens has P - 1 entries (the first token has none);
position P - 1 predicts the first output and belongs to the sampler. The vocabulary-wide fp32 rows exist only
for one slice of positions at a time, so a long prompt never holds [prompt_len, vocab] in memory.

Prefix-cache hits are capped (`usable_prefix_hits`) to the positions already scored: a hit skips the forward of
its tokens, and only that forward gives their logits; reusing the KV would save nothing here, since every
layer's hidden state at those positions is needed anyway. The request still registers its blocks, so later
plain requests hit them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from common.messages import Logprobs

if TYPE_CHECKING:
    from engine_core.batch import SchedulerOutput
    from engine_core.kv_cache import Block
    from engine_core.request import Request

SLICE_ROWS = 256  # positions per log_softmax: 256 x 49k vocab x 4 bytes = 50 MB of fp32 logits at a time


class PromptLogprobs:
    """A request's prompt logprobs so far (positions 0 .. num_done - 1, i.e. tokens 1 .. num_done)."""

    __slots__ = ("k", "token_logprobs", "ranks", "top_ids", "top_logprobs")

    def __init__(self, k: int) -> None:
        self.k = k
        self.token_logprobs: list[float] = []
        self.ranks: list[int] = []
        self.top_ids: list[list[int]] = []
        self.top_logprobs: list[list[float]] = []

    @property
    def num_done(self) -> int:
        return len(self.token_logprobs)

    def message(self) -> Logprobs:
        return Logprobs(self.token_logprobs, self.top_ids, self.top_logprobs, self.ranks)


def new_accumulator(k: int | None, resumed: bool) -> PromptLogprobs | None:
    # A resumed request (a restarted engine) streamed its first output before: the client has its prompt logprobs.
    return None if k is None or resumed else PromptLogprobs(k)


def usable_prefix_hits(req: Request, hits: list[Block], block_size: int) -> list[Block]:
    """The prefix-cache hits a request may take: all, unless it still needs the logits of the positions a hit
    would skip (only those scored before a preemption may be skipped)."""
    acc = req.prompt_logprobs
    return hits if acc is None else hits[: acc.num_done // block_size]


def take_prompt_logprobs(req: Request) -> Logprobs | None:
    """The finished prompt logprobs, once (with the first output); None after, and for requests without."""
    acc = req.prompt_logprobs
    if acc is None:
        return None
    req.prompt_logprobs = None
    return acc.message()


def wants_prompt_logprobs(out: SchedulerOutput) -> bool:
    return any(r.prompt_logprobs is not None for r in out.requests)


@torch.inference_mode()
def score_prompts(model: torch.nn.Module, hidden: torch.Tensor, out: SchedulerOutput, vocab_size: int,
                  pad_rows=lambda n: n) -> None:  # fmt: skip
    """Scores the prompt positions of this step's chunks for the requests that want it, in place on their
    accumulators. Idempotent: a retried step (culprit isolation) recomputes positions already stored, which are
    skipped, so the execute step still changes no request state that a retry could double."""
    rows: list[int] = []
    targets: list[int] = []
    spans: list[tuple[PromptLogprobs, int]] = []  # (accumulator, number of its rows), in row order
    offset = 0
    for req, n in zip(out.requests, out.num_new_tokens, strict=True):
        acc = req.prompt_logprobs
        start = req.num_computed_tokens
        if acc is not None:
            if start > acc.num_done:
                raise RuntimeError(f"prompt logprobs gap: positions {acc.num_done}..{start} were skipped")
            first, last = acc.num_done, min(start + n, req.num_prompt_tokens - 1)
            if first < last:
                rows += range(offset + first - start, offset + last - start)
                targets += req.token_ids[first + 1 : last + 1]
                spans.append((acc, last - first))
        offset += n
    if not rows:
        return
    k = max(acc.k for acc, _ in spans)
    own: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_vals: list[list[float]] = []
    device = hidden.device
    for lo in range(0, len(rows), SLICE_ROWS):
        idx = rows[lo : lo + SLICE_ROWS]
        m = len(idx)
        idx += idx[-1:] * (pad_rows(m) - m)  # few distinct matmul shapes (see padded_size)
        logits = model.compute_logits(hidden[torch.tensor(idx, device=device)])[:m, :vocab_size].float()
        # log_softmax without writing it out: logprob = logit - logsumexp. A token equal to the top one gets the
        # very same float as the top-1 entry (lm-evaluation-harness's is_greedy compares them with ==).
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        target = torch.tensor(targets[lo : lo + m], device=device)
        chosen = logits.gather(1, target[:, None])
        own += (chosen - lse)[:, 0].tolist()
        ranks += ((logits > chosen).sum(dim=-1, dtype=torch.int32) + 1).tolist()  # int32: half the time of int64
        if k:
            vals, ids = logits.topk(k, dim=-1)
            top_ids += ids.tolist()
            top_vals += (vals - lse).tolist()
    pos = 0
    for acc, count in spans:
        acc.token_logprobs += own[pos : pos + count]
        acc.ranks += ranks[pos : pos + count]
        if k:
            acc.top_ids += [t[: acc.k] for t in top_ids[pos : pos + count]]
            acc.top_logprobs += [v[: acc.k] for v in top_vals[pos : pos + count]]
        else:
            acc.top_ids += [[] for _ in range(count)]
            acc.top_logprobs += [[] for _ in range(count)]
        pos += count
