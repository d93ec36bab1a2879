"""The bookkeeping of engine crashes, without a server: the restart budget's window, and which requests a crash
blames (the poison rule). Over HTTP: tests/test_api_crash.py."""

from __future__ import annotations

from common.messages import EngineOutput, EngineRequest, SamplingParams
from frontend.engine.request_stream import RequestStream
from frontend.engine.supervisor import RestartBudget


def test_restart_budget_counts_within_the_window():
    budget = RestartBudget(2, window=10.0)
    assert budget.take(0.0) and budget.take(1.0)
    assert not budget.take(5.0)  # a third within 10 s
    assert budget.take(10.5) and not budget.take(10.6)  # the first has aged out, the second not yet
    assert not RestartBudget(0, 10.0).take(0.0)


def test_only_a_started_request_without_progress_at_two_crashes_running_is_poison():
    def stream() -> RequestStream:
        return RequestStream(EngineRequest("r", [1, 2], SamplingParams(max_tokens=10)), None)

    def token(s: RequestStream, t: int) -> None:
        s.on_output(EngineOutput("r", [t]))

    def start(*streams: RequestStream) -> None:  # the engine's EngineStarted for them
        for s in streams:
            s.started = True

    innocent, poison, newcomer, queued = stream(), stream(), stream(), stream()
    for s in (innocent, poison, queued):
        s.mark_sent()
    start(innocent, poison)
    token(innocent, 5)
    # crash 1: only the poison is implicated; the queued one never ran
    assert not any(s.on_crash() for s in (innocent, poison, queued))
    resent = innocent.mark_sent()
    assert resent.output_token_ids == [5] and resent.params.max_tokens == 10  # resumes after what it streamed
    for s in (poison, newcomer, queued):
        s.mark_sent()
    assert not poison.started  # a new engine: started again only once it says so
    start(innocent, poison, newcomer)
    assert not innocent.on_crash() and not newcomer.on_crash()  # crash 2 at once: implicated only once
    assert not queued.on_crash()  # queued at both crashes: a bystander however long it waits
    assert poison.on_crash()
