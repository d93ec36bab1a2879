"""Scheduling policies and step composition, on a tiny random model driven in-process."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.messages import EngineRequest, SamplingParams
from engine_core.core import EngineCore
from tests.engine_helpers import engine_config


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=3, tie_word_embeddings=True)  # fmt: skip
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def core_for(model: str, **kw) -> EngineCore:
    return EngineCore(engine_config(model=model, dtype="float32", **kw))


def req(rid: str, n_prompt: int, max_tokens: int, priority: int = 0) -> EngineRequest:
    prompt = [(7 * i + len(rid)) % 250 + 4 for i in range(n_prompt)]
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                         priority=priority)  # fmt: skip


def finish_order(core: EngineCore) -> list[str]:
    order = []
    while core.has_work:
        order += [o.request_id for o in core.step() if o.finished]
        core.kv.check_integrity(list(core.scheduler.requests.values()))
    return order


def test_priority_policy_serves_the_most_important_first(tiny_dir) -> None:
    core = core_for(tiny_dir, scheduling_policy="priority", max_num_seqs=1)
    for rid, prio in [("low", 2), ("high", 0), ("mid", 1)]:
        core.add_request(req(rid, 10, 3, prio))
    assert finish_order(core) == ["high", "mid", "low"]


def test_fcfs_serves_in_arrival_order(tiny_dir) -> None:
    core = core_for(tiny_dir, max_num_seqs=1)
    for rid in ["a", "b", "c"]:
        core.add_request(req(rid, 10, 3, priority=-ord(rid)))  # priorities are ignored under fcfs
    assert finish_order(core) == ["a", "b", "c"]


def test_round_robin_time_slices_every_request(tiny_dir) -> None:
    core = core_for(tiny_dir, scheduling_policy="round-robin", max_num_seqs=2)
    for i in range(6):
        core.add_request(req(f"r{i}", 8, 6))
    started: set[str] = set()
    first_finish_seen = False
    while core.has_work:
        out = core.step()
        assert len(out) <= 2  # at most a batch of max_num_seqs per step
        if not first_finish_seen:
            started |= {o.request_id for o in out}
            first_finish_seen = any(o.finished for o in out)
    assert len(started) == 6  # everyone got a token before anyone finished
    assert core.kv.num_used_blocks == 0


def test_long_prompt_never_stalls_running_decodes(tiny_dir) -> None:
    core = core_for(tiny_dir, max_num_batched_tokens=32)
    for i in range(4):
        core.add_request(req(f"d{i}", 6, 40))
    for _ in range(3):
        core.step()
    core.add_request(req("long", 600, 2))
    before = [len(core.scheduler.requests[f"d{i}"].output_token_ids) for i in range(4)]
    for _ in range(20):  # the 600-token prompt takes ~20 chunked steps; decodes go on meanwhile
        produced = {o.request_id for o in core.step()}
        assert {f"d{i}" for i in range(4)} <= produced
    # One token a step each (on CUDA the overlapped decode, engine_core/overlap.py, answers a step later)
    assert all(len(core.scheduler.requests[f"d{i}"].output_token_ids) >= before[i] + 20 for i in range(4))
    # and the prompt took the rest of each step's budget of 32 (all but one step, the one in flight, on CUDA)
    assert core.scheduler.requests["long"].num_computed_tokens >= 19 * (32 - 4)


def test_preemption_recomputes_and_frees(tiny_dir) -> None:
    core = core_for(tiny_dir, num_kv_blocks=12, block_size=16, max_model_len=192)
    for i in range(6):
        core.add_request(req(f"r{i}", 40, 30))
    order = finish_order(core)
    assert sorted(order) == [f"r{i}" for i in range(6)]
    assert core.scheduler.num_preempted > 0 and core.kv.num_used_blocks == 0


def test_abort_is_idempotent_and_frees_at_once(tiny_dir) -> None:
    core = core_for(tiny_dir)
    core.add_request(req("x", 30, 50))
    core.step()
    assert core.kv.num_used_blocks > 0
    core.abort(["x", "x", "never-existed"])
    assert core.kv.num_used_blocks == 0
    assert core.step() == []  # with the overlap (CUDA), this step collects the one in flight and says nothing of x
    assert not core.has_work
