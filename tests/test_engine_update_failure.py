"""A raise inside Scheduler.update (a bug: a grammar matcher error, an assert) fails the request it raised on and
those not yet updated, but every request of the step still hears its end: the outputs made before the raise are
sent, and a request that update finished before making its output gets an ERROR. Before, the outputs were lost
with update's list and the finished ones were skipped, so their streams waited forever."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.messages import EngineOutput, EngineRequest, FinishReason, SamplingParams
from engine_core import scheduler as scheduler_module
from engine_core.batch import SampledTokens, SchedulerOutput
from engine_core.core import EngineCore
from engine_core.kv_cache import KVCacheManager
from engine_core.request import Request
from engine_core.scheduler import Scheduler

TOKEN = 7


class FakeRunner:
    """Samples TOKEN for every sampled row: no model, the step's bookkeeping is what is under test."""

    last_forward_time = 0.0
    lora = SimpleNamespace(retiring=set())  # no LoRA adapters

    def execute(self, out: SchedulerOutput) -> SampledTokens:
        n = sum(1 + len(r.draft_token_ids) for r, s in zip(out.requests, out.sample, strict=True) if s)
        return SampledTokens([TOKEN] * n, [None] * n)


class RaisingGrammar:
    def advance(self, token: int, reason: FinishReason | None) -> FinishReason | None:
        raise RuntimeError("matcher blew up")


def fake_core() -> EngineCore:
    core = object.__new__(EngineCore)  # no model to load: only step's control flow runs
    core.scheduler = Scheduler(KVCacheManager(16, 4, True), 8, 64, 64)
    core.runner = FakeRunner()
    core._rejected, core._seq_no, core.last_step_time, core.pipeline = [], 0, 0.0, None
    return core


def add(core: EngineCore, rid: str, max_tokens: int) -> Request:
    core._seq_no += 1
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = Request(EngineRequest(rid, [1 + core._seq_no] * 3, params), core._seq_no)
    core.scheduler.add(req)
    return req


def run(core: EngineCore) -> dict[str, list[EngineOutput]]:
    outs: dict[str, list[EngineOutput]] = {}
    for _ in range(20):
        if not core.has_work:
            break
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    assert not core.has_work
    return outs


def ends(outs: dict[str, list[EngineOutput]]) -> dict[str, tuple[list[int], FinishReason | None]]:
    """Each request's tokens and finish reason; asserts it finished exactly once, with its last output."""
    for rid, seq in outs.items():
        assert [o.finished for o in seq] == [False] * (len(seq) - 1) + [True], f"{rid}: {seq}"
    return {rid: ([t for o in seq for t in o.new_token_ids], seq[-1].finish_reason) for rid, seq in outs.items()}


def test_outputs_made_before_the_raise_are_sent() -> None:
    """Batch order a, c, b: a finishes on its first token, c goes on, then b's grammar raises."""
    core = fake_core()
    add(core, "a", max_tokens=1)
    add(core, "c", max_tokens=3)
    b = add(core, "b", max_tokens=5)
    b.grammar = RaisingGrammar()  # set after add, so that it is not held back for a compile
    assert ends(run(core)) == {
        "a": ([TOKEN], FinishReason.LENGTH),  # before the fix: no output at all
        "c": ([TOKEN] * 3, FinishReason.LENGTH),  # its update was whole: it goes on
        "b": ([], FinishReason.ERROR),
    }
    core.scheduler.kv.check_integrity([])


def test_a_request_finished_before_its_output_was_made_gets_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The raise comes after update finished `a` (freed, forgotten by the scheduler) but before its output."""
    real = scheduler_module.take_prompt_logprobs

    def take(req: Request):
        if req.request_id == "a":
            raise RuntimeError("boom")
        return real(req)

    monkeypatch.setattr(scheduler_module, "take_prompt_logprobs", take)
    core = fake_core()
    add(core, "c", max_tokens=2)
    a = add(core, "a", max_tokens=1)
    add(core, "b", max_tokens=2)
    got = ends(run(core))
    assert a.finished
    assert got == {
        "c": ([TOKEN] * 2, FinishReason.LENGTH),
        "a": ([], FinishReason.ERROR),  # before the fix: nothing, its stream hung
        "b": ([], FinishReason.ERROR),  # not updated: its step is lost, so it fails as before
    }
    core.scheduler.kv.check_integrity([])
