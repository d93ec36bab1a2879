"""Greedy parity with transformers generate on SmolLM2 under every scheduling path (fp32, in-process engine)."""

from __future__ import annotations

import pytest

from engine_core.core import EngineCore
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
    core, ours = run(fp32_config(num_kv_blocks=40))
    assert core.scheduler.num_preempted > 0
    assert_matches_hf(ours, references)


def test_round_robin_two_seqs_finishes_all(references) -> None:
    prompts = mixed_prompts()[:8]
    core = EngineCore(fp32_config(scheduling_policy="round-robin", max_num_seqs=2))
    reqs = [greedy_request(f"p{i}", p, MAX_NEW) for i, p in enumerate(prompts)]
    ours = tokens_of(run_engine(core, reqs), [r.request_id for r in reqs])
    assert_matches_hf(ours, references[:8])
