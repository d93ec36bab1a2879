"""Scheduling policies under memory pressure: round-robin stays live and rotates; priority never preempts the more
important request for a less important one."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.config import EngineConfig
from common.messages import EngineRequest, SamplingParams
from engine_core.batch import SampledTokens
from engine_core.core import EngineCore
from engine_core.kv_cache import KVCacheManager
from engine_core.request import Request
from engine_core.scheduler import Scheduler


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=3, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def greedy(rid, prompt, max_tokens, priority=0):
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                         priority=priority)


# ---- round-robin: each request's recompute was preempted by the next in the rotation, forever ----

@pytest.mark.parametrize("prefix_caching", [False, True])
def test_round_robin_finishes_under_memory_pressure(tiny_dir, prefix_caching):
    """3 requests of 40 + 80 tokens, a cache of 128 tokens (one max_model_len request), prefill chunks of 32,
    one request per step: each one's recompute is preempted by the next in the rotation before it completes."""
    core = EngineCore(EngineConfig(model=tiny_dir, dtype="float32", scheduling_policy="round-robin",
                                   num_kv_blocks=8, block_size=16, max_model_len=128,
                                   max_num_batched_tokens=32, max_num_seqs=1,
                                   enable_prefix_caching=prefix_caching))
    for i in range(3):
        core.add_request(greedy(f"r{i}", [10 + i + (j % 7) for j in range(40)], 80))
    for _ in range(5000):  # without preemption this needs ~260 steps
        if not core.has_work:
            break
        core.step()
    stuck = {rid: (r.num_tokens, r.num_computed_tokens) for rid, r in core.scheduler.requests.items()}
    assert not core.has_work, f"livelock: {stuck}, {core.scheduler.num_preempted} preemptions"


def test_round_robin_scheduler_only():
    """The same with the Scheduler alone (fake model: token 1 forever)."""
    kv = KVCacheManager(6, 4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=1, max_model_len=24, policy="round-robin")
    s.add(Request(EngineRequest("a", [1], SamplingParams(max_tokens=22, ignore_eos=True)), 1))
    s.add(Request(EngineRequest("b", [1] * 8, SamplingParams(max_tokens=15, ignore_eos=True)), 2))
    for _ in range(3000):
        if not s.has_work:
            break
        out = s.schedule()
        k = sum(out.sample)
        s.update(out, SampledTokens([1] * k, [None] * k), [])
    assert not s.has_work, f"livelock after {s.num_preempted} preemptions"


# ---- priority: the less important request's decodes preempted the more important one ----

def test_priority_policy_never_preempts_a_more_important_request_for_a_less_important_one(tiny_dir):
    core = EngineCore(EngineConfig(model=tiny_dir, dtype="float32", scheduling_policy="priority",
                                   num_kv_blocks=4, block_size=4, max_model_len=16, max_num_batched_tokens=4))
    core.add_request(greedy("low", [5] * 7, 8, priority=5))
    core.step()
    core.step()  # low is decoding, 2 of 4 blocks
    core.add_request(greedy("high", [6] * 8, 4, priority=0))
    high = core.scheduler.requests["high"]
    low = core.scheduler.requests["low"]
    order = []
    while core.has_work:
        order += [o.request_id for o in core.step() if o.finished]
        core.kv.check_integrity(list(core.scheduler.requests.values()))
    # Before the fix: high preempted 3 times by low's decodes, low never; high ran only after low finished.
    assert high.num_preemptions == 0 or low.num_preemptions > 0, (high.num_preemptions, low.num_preemptions, order)


# ---- round-robin: a batch the budget did not reach went back in the same order ----

def test_round_robin_rotation_serves_everyone():
    """A 601-token prompt first in the rotation takes the whole 32-token budget every step; with max_num_seqs >=
    the live requests, the batch goes back to the deque in the same order, so the others wait for its whole
    prefill (before the fix: long 19 steps of 19, d2 and d3 none)."""
    kv = KVCacheManager(200, 16, enable_prefix_caching=True)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=2048, policy="round-robin")
    s.add(Request(EngineRequest("long", [1] * 600 + [2], SamplingParams(max_tokens=2, ignore_eos=True)), 1))
    for i in range(4):
        s.add(Request(EngineRequest(f"d{i}", [3 + i] * 6, SamplingParams(max_tokens=40, ignore_eos=True)), 2 + i))
    served = {rid: 0 for rid in s.requests}
    for _ in range(19):
        out = s.schedule()
        for r in out.requests:
            served[r.request_id] += 1
        k = sum(out.sample)
        s.update(out, SampledTokens([5] * k, [None] * k), [])
    assert min(served.values()) >= 5, served
