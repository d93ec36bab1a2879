"""Preemption in the queue policies, with the Scheduler alone (fake model: token 9 forever, blocks of 4): who is
the victim, that nobody is admitted in a step with a preemption, and what a recompute's prefix hits count as."""

from __future__ import annotations

from common.messages import EngineOutput, EngineRequest, SamplingParams
from engine_core.batch import SampledTokens, SchedulerOutput
from engine_core.kv_cache import KVCacheManager
from engine_core.request import Request, RequestStatus
from engine_core.scheduler import Scheduler


def make(rid: str, prompt: list[int], max_tokens: int, seq_no: int) -> Request:
    return Request(EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)), seq_no)


def step(s: Scheduler) -> tuple[SchedulerOutput, list[EngineOutput]]:
    out = s.schedule()
    k = sum(out.sample)
    outputs: list[EngineOutput] = []
    s.update(out, SampledTokens([9] * k, [None] * k), outputs)
    s.kv.check_integrity(list(s.requests.values()))
    return out, outputs


def test_a_victim_is_not_readmitted_in_the_step_that_preempted_it() -> None:
    """Two requests fill the 4 blocks; at its 9th token `a` needs a third block and preempts `b`, whose 2 freed
    blocks left one over: enough for b's prompt, so the admission loop took b back at once, from position 0."""
    s = Scheduler(KVCacheManager(4, 4, enable_prefix_caching=False), 8, 64, 16)
    a, b = make("a", [1] * 4, 10, 1), make("b", [2] * 4, 10, 2)
    s.add(a)
    s.add(b)
    for _ in range(10):
        out, _ = step(s)
        if b.num_preemptions:
            break
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert out.requests == [a]  # nobody admitted in that step
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and not b.block_ids
    out, _ = step(s)
    assert b in out.requests  # the next step takes it back


def test_the_victim_is_the_newest_request_not_the_last_in_running() -> None:
    """`a`, the oldest, is recomputed after a preemption and so sits last in `running`: it was the next victim
    when `b` needed a block, though `c` is newer."""
    s = Scheduler(KVCacheManager(6, 4, enable_prefix_caching=False), 8, 64, 24)
    a, b, c = (make(rid, [i] * 4, 12, i) for i, rid in enumerate("abc", start=1))
    for r in (a, b, c):
        s.add(r)
    step(s)
    s._preempt(a)
    step(s)
    assert s.running == [b, c, a]
    for _ in range(10):
        step(s)
        if c.num_preemptions or a.num_preemptions > 1:
            break
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (1, 0, 1)


def test_fcfs_requester_newer_than_every_candidate_yields_itself() -> None:
    """Under fcfs as under priority (equal priorities), the newest gives way, also when it is the one short of
    blocks: `b` needs a block while `a` (older) is not scheduled yet this step."""
    s = Scheduler(KVCacheManager(2, 4, enable_prefix_caching=False), 8, 64, 8)
    a, b = make("a", [1] * 4, 3, 1), make("b", [2] * 4, 3, 2)
    s.add(a)
    s.add(b)
    step(s)
    s.running = [b, a]  # b first in the decode order: it asks for its second block before a does
    step(s)
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)


def test_a_recomputes_hits_count_neither_as_cached_prompt_nor_in_the_prefix_stats() -> None:
    """`b` is preempted with 16 tokens of prompt and outputs in full blocks; re-admitted, its own blocks hit, which
    made num_cached_tokens (reported as cached_tokens of usage) larger than its 4-token prompt and counted the
    recompute as prefix-cache queries and hits."""
    s = Scheduler(KVCacheManager(6, 4, enable_prefix_caching=True), 4, 64, 24)
    a, b = make("a", [1, 2, 3, 4, 9, 9, 9, 9], 6, 1), make("b", [5, 6, 7, 8], 16, 2)
    s.add(a)
    s.add(b)
    cached: dict[str, int] = {}
    for _ in range(60):
        if not s.has_work:
            break
        for o in step(s)[1]:
            cached[o.request_id] = max(cached.get(o.request_id, 0), o.num_cached_tokens)
    assert b.num_preemptions == 1 and b.num_tokens == 20
    assert cached == {"a": 0, "b": 4}  # re-admitted b did hit its own blocks, but only prompt tokens count
    assert (s.prefix_queries, s.prefix_hits) == (8 + 4, 0)  # first admissions only
