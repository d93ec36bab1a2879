"""bench/reliability/: its pure helpers (metrics text, SSE folding, outcome checks, the mix plan); no server."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from bench.reliability.big_body import big_json_body, parse_status_line
from bench.reliability.cli import is_loopback, parse_args
from bench.reliability.client import METRIC_BLOCKS, METRIC_RUNNING, bounded_gather, parse_metrics
from bench.reliability.outcome import Outcome, problem, read_event, tally
from bench.reliability.plan import mix_body, mix_plan, scaled
from bench.reliability.probe import rss_mb

METRICS_TEXT = """# HELP roseinfer:num_requests_running Requests in the engine's running batch
# TYPE roseinfer:num_requests_running gauge
roseinfer:num_requests_running{model_name="SmolLM2-135M-Instruct"} 3.0
roseinfer:kv_cache_blocks_in_use{model_name="a b"} 7.0
roseinfer:request_success_total{finished_reason="length",model_name="m"} 2.0
roseinfer:request_success_total{finished_reason="stop",model_name="m"} 5.0
"""


def test_parse_metrics_sums_label_sets() -> None:
    m = parse_metrics(METRICS_TEXT)
    assert m[METRIC_RUNNING] == 3.0
    assert m[METRIC_BLOCKS] == 7.0  # a space inside a label value does not split the line wrongly
    assert m["roseinfer:request_success_total"] == 7.0


def test_scaled_never_reaches_zero() -> None:
    assert scaled(512, 0.05) == 26
    assert scaled(3000, 1.0) == 3000
    assert scaled(8, 0.001) == 1


def test_loopback_only() -> None:
    assert is_loopback("http://127.0.0.1:8000")
    assert is_loopback("http://localhost:8000")
    assert is_loopback("http://[::1]:8000")
    assert not is_loopback("http://10.0.0.1:8000")
    assert not is_loopback("http://example.com")


def test_status_line() -> None:
    assert parse_status_line(b"HTTP/1.1 413 Request Entity Too Large\r\n") == 413
    assert parse_status_line(b"HTTP/1.1 200\r\n") == 200
    assert parse_status_line(b"") is None
    assert parse_status_line(b"garbage here") is None


def test_big_body_is_valid_json_of_the_exact_size() -> None:
    body = big_json_body(10_000)
    assert len(body) == 10_000
    assert len(json.loads(body)["prompt"]) == 10_000 - len(b'{"prompt": ""}')
    with pytest.raises(ValueError):
        big_json_body(5)


def test_rss_of_this_process() -> None:
    rss = rss_mb(os.getpid())
    assert rss is None or rss > 1.0  # None off Linux
    assert rss_mb(None) is None


def stream_of(*events: dict) -> Outcome:
    o = Outcome(status=200)
    for i, event in enumerate(events):
        read_event(o, event, 0.1 * (i + 1))
    return o


def test_read_event_chat_and_completions() -> None:
    chat = stream_of({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
                     {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
                     {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
                     {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})  # fmt: skip
    assert (chat.content_chunks, chat.ttft, chat.finish_reasons, chat.completion_tokens) == (1, 0.2, {0: "length"}, 1)
    text = stream_of({"choices": [{"index": 1, "text": "a", "finish_reason": None}]},
                     {"choices": [{"index": 1, "text": "", "finish_reason": "stop"}]})  # fmt: skip
    assert (text.content_chunks, text.finish_reasons) == (1, {1: "stop"})
    err = stream_of({"error": {"message": "boom", "code": "engine_error"}})
    assert "boom" in err.error_event


def test_problem_kinds() -> None:
    good = Outcome(status=200, done=True, finish_reasons={0: "length"}, completion_tokens=16)
    assert problem(good, True, 1, (16, 16), frozenset({"length"})) is None
    assert problem(Outcome(status=200, finish_reasons={0: "length"}, completion_tokens=16), True) == "no_done"
    assert problem(Outcome(status=503), True) == "http_503"
    assert problem(Outcome(exception="ReadTimeout: x"), False) == "exception:ReadTimeout"
    assert problem(Outcome(status=200, done=True, error_event="{}"), True) == "error_event"
    short = Outcome(status=200, done=True, finish_reasons={0: "length"}, completion_tokens=15)
    assert problem(short, True, 1, (16, 16)) == "wrong_token_count"
    assert problem(Outcome(status=200, done=True, finish_reasons={0: "stop"}), True, 2) == "missing_finish"
    aborted = Outcome(status=200, done=True, finish_reasons={0: "abort"})
    assert problem(aborted, True) == "finish_abort"
    # A stream we cut ourselves is fine, whatever it lacks.
    assert problem(Outcome(status=200, closed_by_us=True), True, 3, (1, 1)) is None


def test_tally_counts_unfinished_and_kinds() -> None:
    ok = Outcome(status=200, done=True)
    bad = Outcome(status=500, body="oops")
    t = tally([(ok, None), (bad, "http_500"), None])
    assert (t["sent"], t["finished"], t["unfinished"], t["errors"]) == (3, 2, 1, 1)
    assert t["error_kinds"] == {"http_500": 1} and t["statuses"] == {"200": 1, "500": 1}
    assert t["first_errors"] == ["http_500: oops"]


def test_mix_plan_is_seeded_and_valid() -> None:
    plan = mix_plan(3000, seed=1)
    assert plan == mix_plan(3000, seed=1) and plan != mix_plan(3000, seed=2)
    streams = [s for s in plan if s.stream]
    closes = [s for s in plan if s.close_after is not None]
    assert all(s.stream for s in closes)  # only streams are cut
    assert 0.09 < len(closes) / len(streams) < 0.15
    assert {s.n for s in plan} == {1, 2, 3} and {s.chat for s in plan} == {True, False}
    assert any(s.stop for s in plan) and any(s.seed is not None for s in plan)
    path, body = mix_body(next(s for s in plan if s.chat and s.stream), "m")
    assert path == "/v1/chat/completions" and body["messages"] and body["stream_options"] == {"include_usage": True}
    path, body = mix_body(next(s for s in plan if not s.chat and not s.stream), "m")
    assert path == "/v1/completions" and isinstance(body["prompt"], str) and "stream_options" not in body


def test_bounded_gather_cuts_what_runs_too_long() -> None:
    async def value(v: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return v

    results, timed_out = asyncio.run(bounded_gather([value(1, 0.0), value(2, 10.0), value(3, 0.01)], 0.5))
    assert results == [1, None, 3] and timed_out


def test_args_refuse_remote_urls_and_unknown_scenarios() -> None:
    assert parse_args(["--url", "http://127.0.0.1:8000", "--scenarios", "mix,hostile"]).scenario_names == [
        "mix", "hostile"]  # fmt: skip
    for argv in (["--url", "http://192.168.1.2:8000"], ["--url", "http://127.0.0.1:1", "--scenarios", "nope"], []):
        with pytest.raises(SystemExit):
            parse_args(argv)
