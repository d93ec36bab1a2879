"""Batched sampling: per-request logits processors (penalties, logit_bias, allowed_token_ids, bad_words, min_tokens),
temperature, top-k / top-p / min-p, seeded draws, and logprobs.

A seeded request's randomness is a function of (seed, output position) only, so it draws the same
tokens whatever else shares its batch, and a resumed stream continues exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from common.config import LOGPROBS_MODES
from common.messages import Logprobs, SamplingParams
from engine_core.batch import LogprobRows
from engine_core.cpu_kernels import cpu_kernels
from engine_core.request import Request
from engine_core.structured import apply_masks
from engine_core.transfer import to_device

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over the 63-bit seed space
# The largest temperature float32 holds. Any above it divides every finite logit to the same value, so clamping
# changes no draw; left alone it would become inf, and a masked logit's -inf / inf a NaN row.
_MAX_TEMPERATURE = float(torch.finfo(torch.float32).max)


class Sampler:
    def __init__(self, device: torch.device, vocab_size: int, seed: int = 0,
                 logprobs_mode: str = "raw_logprobs") -> None:  # fmt: skip
        # What logprobs report: the model's own distribution (raw), or the one each token was drawn from
        # (processed: _drawn_from); as log probabilities, or as the logits themselves.
        assert logprobs_mode in LOGPROBS_MODES, logprobs_mode
        self.device = device
        self.vocab_size = vocab_size
        self.logprobs_mode = logprobs_mode
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seeded = torch.Generator(device=device)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request], offsets: list[int] | None = None,
                 in_flight: torch.Tensor | None = None) -> tuple[list[int], list[Logprobs | None]]:  # fmt: skip
        """logits: [N, vocab] in the model's dtype, one row per request, in order. offsets: how far past the
        request's outputs each row's position is (a draft's rows, engine_core/speculative.py, or a token in flight);
        0 by default. in_flight [N]: where offsets[i] is 1 in an overlapped step (ModelRunner.launch), the token
        row i's request has in flight, on the logits' device: processors count it as its last output."""
        tokens, logprobs = self.sample_on_device(logits, requests, offsets or [0] * len(requests), in_flight)
        return tokens.tolist(), logprobs.to_lists() if logprobs is not None else [None] * len(requests)

    def sample_on_device(self, logits: torch.Tensor, requests: list[Request], offsets: list[int],
                         in_flight: torch.Tensor | None = None) -> tuple[torch.Tensor, LogprobRows | None]:  # fmt: skip
        """The tokens, and the logprobs asked for, as tensors on the logits' device: nothing read back, so that an
        overlapped step (engine_core/overlap.py) reads them only after launching the next one."""
        params = [r.params for r in requests]
        raw = logits[:, : self.vocab_size]
        logits = self._process(raw, requests, offsets, in_flight)
        kernels = cpu_kernels() if logits.device.type == "cpu" else None
        if all(p.greedy for p in params):
            tokens = _argmax(logits)
        elif kernels is not None and kernels.handles(logits):
            # Every row through the compiled sampler, one uniform number each (a seeded row's own): a row's token
            # depends on its logits, its settings and its number alone, whatever shares the batch.
            vocab = logits.shape[-1]
            temps = torch.tensor([0.0 if p.greedy else _temperature(p) for p in params])
            top_k = torch.tensor([min(p.top_k, vocab) for p in params])
            top_p, min_p = torch.tensor([p.top_p for p in params]), torch.tensor([p.min_p for p in params])
            uniforms = torch.rand(len(params), generator=self.generator)
            for i, req in enumerate(requests):
                if req.params.seed is not None:
                    self._seeded.manual_seed(_seed_for(req, offsets[i]))
                    uniforms[i] = torch.rand(1, generator=self._seeded)[0]
            tokens = kernels.sample_rows(logits.contiguous(), temps, top_k, top_p, min_p, uniforms)
        else:
            tokens = self._sample(logits.float(), requests, params, offsets)
        if all(p.logprobs is None for p in params):
            return tokens, None
        source = raw if self.logprobs_mode.startswith("raw") else _drawn_from(logits, params)
        return tokens, _logprobs(source, tokens, params, normalize=self.logprobs_mode.endswith("logprobs"))

    def _process(self, raw: torch.Tensor, requests: list[Request], offsets: list[int],
                 in_flight: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """The rows after their processors: a fp32 copy (as transformers applies them), or `raw` where none asks."""
        if not any(needs_processing(r.params) for r in requests):
            return raw
        logits = raw.to(torch.float32, copy=True)
        _penalize(logits, requests, offsets, in_flight)  # the first processor, batched over the rows
        for i, req in enumerate(requests):
            if _needs_row_processors(req.params):
                for process in LOGITS_PROCESSORS:
                    process(logits[i], req, req.num_output_tokens + offsets[i])
        apply_masks(logits, raw, requests)  # grammars last, batched over the constrained rows
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[Request], params: list[SamplingParams],
                offsets: list[int]) -> torch.Tensor:  # fmt: skip
        """torch's way (CUDA, or no compiled kernels): the same filters, drawn by an exponential race."""
        probs = _filtered_probs(_at_temperature(logits, params), params)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; each row's E has its own source.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, (req, p) in enumerate(zip(requests, params, strict=True)):
            if p.seed is not None:
                self._seeded.manual_seed(_seed_for(req, offsets[i]))
                noise[i].exponential_(generator=self._seeded)
        sampled = (probs / noise).argmax(dim=-1)
        greedy_rows = to_device([p.greedy for p in params], logits.device)
        return torch.where(greedy_rows, logits.argmax(dim=-1), sampled)


def _at_temperature(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """fp32 rows divided by their temperatures (1 for a greedy row)."""
    return logits / to_device([1.0 if p.greedy else _temperature(p) for p in params], logits.device)[:, None]


def _filtered_probs(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Rows at their temperatures (_at_temperature) as probabilities, then min-p, top-k and top-p: 0 for every token
    they drop."""
    probs = torch.softmax(scaled, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = to_device([p.min_p for p in params], probs.device)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        probs = _top_k_top_p(probs, params)
    return probs


def _drawn_from(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The logits each row's token was drawn from (--logprobs-mode processed_*): after the processors, a greedy row
    as it is, a sampled row at its temperature with what its filters drop at -inf."""
    drawn = logits.float()
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        drawn = drawn.clone()
        rows = to_device(sampled, logits.device, torch.long)
        chosen = [params[i] for i in sampled]
        scaled = _at_temperature(drawn[rows], chosen)
        drawn[rows] = scaled.masked_fill(_filtered_probs(scaled, chosen) == 0, float("-inf"))
    return drawn


def _temperature(p: SamplingParams) -> float:
    return min(p.temperature, _MAX_TEMPERATURE)


def _seed_for(req: Request, offset: int = 0) -> int:
    assert req.params.seed is not None
    return (req.params.seed * _SEED_MIX + req.num_output_tokens + offset) & (2**63 - 1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    kernels = cpu_kernels() if logits.device.type == "cpu" else None
    if kernels is not None and kernels.handles(logits) and logits.is_contiguous():
        return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


# ---- logits processors: adjustments in place on fp32 rows: penalties (batched), then the rest, row by row ----


def _needs_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _needs_row_processors(p: SamplingParams) -> bool:
    """Whether one of LOGITS_PROCESSORS changes this request's row (a new one adds its condition here)."""
    return bool(p.logit_bias) or bool(p.allowed_token_ids) or bool(p.bad_words) or p.min_tokens > 0


def needs_processing(p: SamplingParams) -> bool:
    """Whether any processor changes this request's row: penalties, the row processors, a grammar's mask."""
    return _needs_penalty(p) or _needs_row_processors(p) or p.structured is not None


def processes_beside_a_token_in_flight(p: SamplingParams) -> bool:
    """Whether every processor this request asks for can run while its last token is still on the device
    (engine_core/overlap.py): all but bad_words and grammars, which read that token's value on the host."""
    return not p.bad_words and p.structured is None


def _penalize(logits: torch.Tensor, requests: list[Request], offsets: list[int], in_flight: torch.Tensor | None,
              ) -> None:  # fmt: skip
    """HF's repetition penalty over each row's prompt and outputs, then OpenAI's presence and frequency penalties over
    its outputs: every row that asks at once, touching only the tokens that occurred (per-row tensor ops cost about
    80 us a row on CPU, and a device sync each on CUDA). Repeated ids need no dedup: a penalty that is set writes the
    same value for each copy, computed from the values before it; the frequency penalty adds up, once per copy. A
    token in flight (Sampler.__call__) is one more output, read on the device."""
    flat = logits.view(-1)
    rep = [(i, r) for i, r in enumerate(requests) if r.params.repetition_penalty != 1.0]
    if rep:
        keys, penalty = _occurrences(rep, logits, offsets, in_flight, lambda p: [p.repetition_penalty])
        vals = flat[keys]
        flat[keys] = torch.where(vals > 0, vals / penalty[0], vals * penalty[0])
    counted = [(i, r) for i, r in enumerate(requests) if r.num_output_tokens + offsets[i]
               and (r.params.presence_penalty or r.params.frequency_penalty)]  # fmt: skip
    if counted:
        per_token = lambda p: [p.presence_penalty, p.frequency_penalty]  # noqa: E731
        keys, (presence, frequency) = _occurrences(counted, logits, offsets, in_flight, per_token, outputs_only=True)
        flat[keys] = flat[keys] - presence
        flat.index_put_((keys,), -frequency, accumulate=True)


def _occurrences(rows: list[tuple[int, Request]], logits: torch.Tensor, offsets: list[int],
                 in_flight: torch.Tensor | None, values: Callable[[SamplingParams], list[float]],
                 outputs_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each token occurrence of the rows' requests (or of their outputs), and each token they have in flight, as an
    index into the flattened [rows, vocab] logits; and `values` of its request's params for each occurrence (one row
    of the second tensor each)."""
    vocab, device = logits.shape[1], logits.device
    ids = [r.token_array()[r.num_prompt_tokens if outputs_only else 0 :] for _, r in rows]
    ids = [t[t < vocab] for t in ids]
    counts = [len(t) for t in ids]
    keys = np.concatenate([t + i * vocab for (i, _), t in zip(rows, ids, strict=True)])
    per_row = np.array([values(r.params) for _, r in rows], dtype=np.float32)
    per_key = np.repeat(per_row, counts, axis=0)
    flying = [(i, k) for k, (i, _) in enumerate(rows) if offsets[i] and in_flight is not None]
    if not flying:
        return to_device(keys, device), to_device(per_key.T, device)
    assert in_flight is not None
    at = to_device([i for i, _ in flying], device, torch.long)
    tokens = in_flight[at]  # sampled ids: always inside the row
    flying_keys = at * vocab + tokens
    flying_values = to_device(per_row[[k for _, k in flying]], device)
    return (torch.cat([to_device(keys, device), flying_keys]),
            torch.cat([to_device(per_key, device), flying_values]).T)  # fmt: skip


def _add_logit_bias(row: torch.Tensor, req: Request, num_outputs: int) -> None:
    """OpenAI's logit_bias: token id -> value added to its logit (the engine checked ids and range)."""
    bias = req.params.logit_bias
    if bias:
        ids = to_device(list(bias), row.device, torch.long)  # to_device: a pageable copy would wait for the GPU
        row[ids] += to_device(list(bias.values()), row.device, row.dtype)


def _keep_allowed(row: torch.Tensor, req: Request, num_outputs: int) -> None:
    """vLLM's allowed_token_ids: every other token masked out (the engine checked the ids)."""
    allowed = req.params.allowed_token_ids
    if allowed:
        ids = to_device(allowed, row.device, torch.long)
        kept = row[ids]
        row.fill_(float("-inf"))
        row[ids] = kept


def _ban_bad_words(row: torch.Tensor, req: Request, num_outputs: int) -> None:
    """vLLM's bad_words: each sequence's last token is banned where the outputs end with the rest of it (a
    one-token word always). Never beside a token in flight (processes_beside_a_token_in_flight)."""
    ids = req.token_ids
    for word in req.params.bad_words:
        head = word[:-1]
        if len(head) <= num_outputs and ids[len(ids) - len(head) :] == head:
            row[word[-1]] = float("-inf")


def _ban_early_stops(row: torch.Tensor, req: Request, num_outputs: int) -> None:
    """EOS / stop ids held back until min_tokens is reached. Last, so that no bias can lift the ban."""
    p = req.params
    if num_outputs < p.min_tokens:
        banned = [t for t in (*p.stop_token_ids, *req.eos_token_ids) if 0 <= t < row.shape[0]]
        if banned:
            row[to_device(banned, row.device, torch.long)] = float("-inf")


LOGITS_PROCESSORS = (_add_logit_bias, _keep_allowed, _ban_bad_words, _ban_early_stops)


def _top_k_top_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p over the mass top-k kept (as vLLM and transformers), on probabilities after min-p."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # equal weights: lower index first
    vocab = probs.shape[-1]
    # Clamped to the vocabulary: top_k beyond it means "all", and never overflows the int64 tensor.
    top_k = to_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], probs.device)
    top_p = to_device([p.top_p for p in params], probs.device)
    rank = torch.arange(vocab, device=probs.device)[None, :]
    sorted_probs = sorted_probs * (rank < top_k[:, None])
    # A token stays while the mass before it is below top-p (the first always). top_p 1 keeps all: the cumulative
    # sum can round past the total, and must not drop the tail of a row that asked for none.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    total = sorted_probs.sum(dim=-1, keepdim=True)
    sorted_probs = sorted_probs * ((mass_before < top_p[:, None] * total) | (top_p[:, None] >= 1.0))
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _logprobs(source: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams],
              normalize: bool = True) -> LogprobRows:  # fmt: skip
    """Each row's chosen token's value and its top n, from `source` (logits) or its log-softmax (`normalize`)."""
    logp = torch.log_softmax(source.float(), dim=-1) if normalize else source.float()
    max_n = max(p.logprobs or 0 for p in params)
    top_values, top_ids = logp.topk(max_n, dim=-1) if max_n else (None, None)
    return LogprobRows(logp.gather(1, tokens[:, None])[:, 0], top_ids, top_values, [p.logprobs for p in params])
