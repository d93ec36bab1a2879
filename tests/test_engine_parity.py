"""Greedy parity with transformers generate on SmolLM2 under every scheduling path (fp32, in-process engine)."""

from __future__ import annotations

import pytest
import torch

from engine_core.core import EngineCore
from engine_core.models.layers import PackedLinear, can_pack_bf16
from tests.engine_helpers import (
    assert_matches_hf,
    fp32_config,
    greedy_request,
    hf_greedy,
    mixed_prompts,
    run_engine,
    tokens_of,
)

MAX_NEW = 64


@pytest.fixture(scope="module")
def references():
    return hf_greedy(mixed_prompts(), MAX_NEW)


def run(config, stagger: int = 0):
    core = EngineCore(config)
    reqs = [greedy_request(f"p{i}", p, MAX_NEW) for i, p in enumerate(mixed_prompts())]
    results = run_engine(core, reqs, stagger=stagger)
    return core, tokens_of(results, [r.request_id for r in reqs])


def test_all_at_once_matches_hf(references) -> None:
    _, ours = run(fp32_config())
    assert_matches_hf(ours, references)


def test_staggered_arrivals_match_hf(references) -> None:
    _, ours = run(fp32_config(), stagger=3)
    assert_matches_hf(ours, references)


def test_prefix_caching_off_matches_hf(references) -> None:
    _, ours = run(fp32_config(enable_prefix_caching=False))
    assert_matches_hf(ours, references)


def test_chunked_prefill_budget_32_matches_hf(references) -> None:
    core, ours = run(fp32_config(max_num_batched_tokens=32))
    assert_matches_hf(ours, references)


def test_preemption_with_a_tiny_kv_cache_matches_hf(references) -> None:
    # 40 blocks of 16 = 640 tokens: room for about two of the long prompts at a time.
    core, ours = run(fp32_config(num_kv_blocks=40, max_model_len=640))
    assert core.scheduler.num_preempted > 0
    assert_matches_hf(ours, references)


def test_round_robin_two_seqs_finishes_all(references) -> None:
    """Eight requests take turns two at a time (a step per pair), each for half the references' tokens: greedy
    output is a prefix of the longer run's."""
    prompts, n = mixed_prompts()[:8], MAX_NEW // 2
    core = EngineCore(fp32_config(scheduling_policy="round-robin", max_num_seqs=2))
    reqs = [greedy_request(f"p{i}", p, n) for i, p in enumerate(prompts)]
    ours = tokens_of(run_engine(core, reqs), [r.request_id for r in reqs])
    assert_matches_hf(ours, [(tokens[:n], top2[:n]) for tokens, top2 in references[:8]])


def test_bfloat16_fast_path_tracks_fp32(references) -> None:
    """The production path on this CPU: bf16 with packed linears and every compiled kernel. bf16 rounding makes
    parity with fp32 impossible over 64 tokens; measured against HF's fp32 greedy path, transformers' own bf16
    generate leaves it after 33 tokens on average, at a token outside HF's top-2 in 1 prompt of 16 (our bf16
    torch path: 39 and 2, this path: 36 and 1 on 2026-11-25). A wrong kernel diverges at once, everywhere."""
    core, ours = run(fp32_config(dtype="bfloat16", max_num_batched_tokens=256))
    assert core.runner.dtype == torch.bfloat16
    # Linears are packed on a CPU that runs bf16 matmuls (our kernels: AVX512-BF16 or AVX2 + FMA; or oneDNN's
    # AVX512); on CUDA the plain ones run on cuBLAS, and on an older CPU on torch's emulation.
    packs = core.runner.device.type == "cpu" and can_pack_bf16()
    assert isinstance(core.runner.model.lm_head, PackedLinear) == packs
    diverged = [next((j for j, (a, b) in enumerate(zip(t, r, strict=True)) if a != b), None)
                for t, (r, _) in zip(ours, references, strict=True)]  # fmt: skip
    far = [i for i, j in enumerate(diverged) if j is not None and ours[i][j] != references[i][1][j][1]]
    agreed = [MAX_NEW if j is None else j for j in diverged]
    # Torch's emulated bf16 matmuls (no packed linears) left the top-2 in 3 prompts of 16 (2026-11-26).
    assert len(far) <= (3 if not packs else 2) and sum(agreed) / len(agreed) >= 16, (far, agreed)
