"""Min-p, top-k and top-p: the compiled CPU sampler and torch's path keep exactly the tokens of the definition (min-p,
then top-k, then top-p over what top-k kept, tokens in descending weight and ascending index among equal weights),
and the compiled sampler draws each in proportion to its weight."""

from __future__ import annotations

import pytest
import torch

from common.messages import EngineRequest, SamplingParams
from engine_core.cpu_kernels import cpu_kernels
from engine_core.request import Request
from engine_core.sampler import Sampler, _top_k_top_p

GRID = 4096  # uniform numbers (j + 0.5) / GRID: an inverse-CDF draw then gives each token its share of them


def kept_by_definition(row: torch.Tensor, temp: float, top_k: int, top_p: float, min_p: float) -> dict[int, float]:
    """Token -> its probability among the kept ones, straight from the definition, in float64."""
    w = torch.exp((row.double().clamp(min=-1e30) - row.double().max()) / temp)
    w[w < min_p] = 0.0
    order = sorted((i for i in range(len(w)) if w[i] > 0), key=lambda i: (-w[i].item(), i))
    if top_k > 0:
        order = order[:top_k]
    total, kept, before = sum(w[i].item() for i in order), [], 0.0
    for i in order:
        if kept and top_p < 1.0 and before >= top_p * total:
            break
        kept.append(i)
        before += w[i].item()
    mass = sum(w[i].item() for i in kept)
    return {i: w[i].item() / mass for i in kept}


def cases() -> list[tuple[torch.Tensor, float, int, float, float]]:
    gen = torch.Generator().manual_seed(5)
    peaked = torch.randn(1000, generator=gen) * 4  # a few tokens hold most of the mass
    flat = torch.randn(1003, generator=gen) * 0.3  # top-p reaches deep; an odd width
    ties = (torch.randint(0, 6, (777,), generator=gen).float() / 2)  # many equal logits
    masked = torch.randn(500, generator=gen) * 2
    level = torch.randn(4000, generator=gen) * 0.01  # within a few percent: the cut's range is split further
    masked[::3] = float("-inf")
    return [
        (peaked, 1.0, 0, 0.9, 0.0), (peaked, 0.7, 20, 0.8, 0.0), (peaked, 1.3, 0, 1.0, 0.05),
        (flat, 1.0, 0, 0.95, 0.0), (flat, 0.5, 300, 0.5, 0.0), (flat, 1.0, 0, 0.3, 0.2),
        (ties, 1.0, 5, 1.0, 0.0), (ties, 1.0, 0, 0.6, 0.0), (ties, 0.8, 100, 0.9, 0.1),
        (masked, 1.0, 10, 0.7, 0.0), (masked, 2.0, 0, 0.99, 0.01), (peaked, 1.0, 1000, 1.0, 0.0),
        (level, 1.0, 0, 0.5, 0.0), (level, 1.0, 1500, 1.0, 0.0), (level, 0.5, 3000, 0.3, 0.0),
        # top-k of at most 256 that drops tokens: the rest are gathered and filtered alone (sample.c, sample_few)
        (flat, 1.0, 256, 0.9, 0.0), (flat, 1.0, 257, 0.9, 0.0), (ties, 1.0, 7, 0.5, 0.0), (level, 1.0, 64, 0.4, 0.0),
        (peaked, 1.0, 50, 0.95, 0.3),  # min-p leaves fewer than 50: top-k drops nothing
    ]  # fmt: skip


@pytest.mark.skipif(cpu_kernels() is None, reason="needs the compiled CPU kernels (a C compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_sampler_draws_the_kept_tokens_in_proportion(dtype: torch.dtype) -> None:
    kernels = cpu_kernels()
    assert kernels is not None
    for row, temp, top_k, top_p, min_p in cases():
        row = row.to(dtype)
        want = kept_by_definition(row, temp, top_k, top_p, min_p)
        batch = row.expand(GRID, -1).contiguous()
        full = [torch.full((GRID,), v) for v in (temp, top_k, top_p, min_p)]
        uniforms = (torch.arange(GRID, dtype=torch.float64) + 0.5) / GRID
        drawn = kernels.sample_rows(batch, full[0], full[1].long(), full[2], full[3], uniforms.float())
        counts = torch.bincount(drawn, minlength=row.shape[0])
        assert set(drawn.tolist()) <= set(want), (temp, top_k, top_p, min_p, set(drawn.tolist()) - set(want))
        for token, p in want.items():  # each kept token owns a share p of the grid, give or take one point
            assert abs(counts[token].item() - p * GRID) <= 1.5, (temp, top_k, top_p, min_p, token, p)


def test_torch_path_keeps_the_same_tokens() -> None:
    """CUDA (and a machine without a compiler) samples with torch: the tokens it can draw are the same."""
    for row, temp, top_k, top_p, min_p in cases():
        params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
        probs = torch.softmax(row.float().clamp(min=-1e30)[None] / temp, dim=-1)
        if min_p > 0:
            probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
        kept = _top_k_top_p(probs, [params])[0].nonzero().flatten().tolist()
        assert set(kept) == set(kept_by_definition(row, temp, top_k, top_p, min_p)), (temp, top_k, top_p, min_p)


def test_a_seeded_filtered_row_draws_the_same_at_any_place_in_any_batch() -> None:
    """Batch-invariance with the filters on, an odd vocabulary (rows at unaligned addresses), and neighbours that
    turn the batch into fp32 (a penalty) or leave it in bf16."""
    vocab = 1003
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(6, vocab, generator=gen) * 2).to(torch.bfloat16)
    seeded = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=99)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_p=0.5),
              SamplingParams(temperature=1.0, presence_penalty=0.5), SamplingParams(temperature=0)]  # fmt: skip
    sampler = Sampler(torch.device("cpu"), vocab, seed=0)

    def request(params: SamplingParams, i: int) -> Request:
        return Request(EngineRequest(f"r{i}", [1, 2], params, eos_token_ids=[0], output_token_ids=[7, 8]), i)

    alone, _ = sampler(logits[:1], [request(seeded, 0)])
    for place in range(1, 6):
        for neighbour in others:
            rows = torch.cat([logits[1:place], logits[:1], logits[place:]])
            reqs = [request(neighbour, i) for i in range(5)]
            reqs.insert(place - 1, request(seeded, 9))
            tokens, _ = sampler(rows, reqs)
            assert tokens[place - 1] == alone[0], (place, neighbour)


@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_a_huge_temperature_still_draws_only_tokens_the_processors_allow(path: str, monkeypatch) -> None:
    """Any finite temperature is valid (vLLM's bound). Past float32's range it used to become inf, and -inf / inf a
    NaN row; from about 1e30 the compiled sampler's masked weight, exp((NO_SCORE - max) / T), stopped being 0."""
    if path == "torch":
        monkeypatch.setattr("engine_core.sampler.cpu_kernels", lambda: None)
    elif cpu_kernels() is None:
        pytest.skip("needs the compiled CPU kernels (a C compiler)")
    vocab = 1000
    logits = (torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 10).to(torch.bfloat16)
    sampler = Sampler(torch.device("cpu"), vocab, seed=0)
    for temp in [100.0, 1e30, 1e38, 3.5e38, 1e308]:
        for params, allowed in [(SamplingParams(temperature=temp, allowed_token_ids=[5, 7, 11]), {5, 7, 11}),
                                (SamplingParams(temperature=temp, allowed_token_ids=[0, 9], min_tokens=2), {9}),
                                (SamplingParams(temperature=temp, top_k=3, allowed_token_ids=[2, 4]), {2, 4})]:
            reqs = [Request(EngineRequest(f"r{i}", [1, 2], params, eos_token_ids=[0]), i) for i in range(64)]
            tokens, _ = sampler(logits.expand(64, -1), reqs)
            assert set(tokens) == allowed, (temp, params, set(tokens) - allowed)
        # Nothing masked: the draw spreads over the vocabulary, as a temperature that flattens every logit does.
        reqs = [Request(EngineRequest(f"u{i}", [1, 2], SamplingParams(temperature=temp)), i) for i in range(64)]
        tokens, _ = sampler(logits.expand(64, -1), reqs)
        assert len(set(tokens)) > (32 if temp > 1e30 else 8), (temp, len(set(tokens)))
