"""Prometheus metrics of the API process, named like vLLM's with the `roseinfer:` prefix."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from common.messages import SchedulerStats
from frontend.request_stream import RequestStream

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                    80.0, 160.0)  # fmt: skip


class Metrics:
    """One registry per app (tests create several apps in one process)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"roseinfer:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"roseinfer:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"roseinfer:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the engine's running batch")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting in the engine")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)")
        self.kv_cache_blocks_in_use = gauge("kv_cache_blocks_in_use", "KV cache blocks held by requests")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.num_preemptions = counter("num_preemptions", "Requests preempted by the scheduler")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens sent to the engine")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.engine_restarts = counter("engine_restarts", "Engine core restarts after a crash or a hang")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between two outputs of one request")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last output")
        self.request_success = Counter("roseinfer:request_success", "Finished requests by finish reason",
                                       ["model_name", "finished_reason"], registry=r)  # fmt: skip
        self._model_name = model_name
        self._last = SchedulerStats()

    def observe_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_usage)
        self.kv_cache_blocks_in_use.set(stats.num_blocks_in_use)
        # The engine reports running totals; a restarted engine starts again from zero.
        for counter, now, before in (
            (self.prefix_cache_queries, stats.prefix_queries, self._last.prefix_queries),
            (self.prefix_cache_hits, stats.prefix_hits, self._last.prefix_hits),
            (self.num_preemptions, stats.num_preempted, self._last.num_preempted),
        ):
            counter.inc(now - before if now >= before else now)
        self._last = stats

    def observe_output(self, stream: RequestStream, num_new_tokens: int, previous_token_time: float | None) -> None:
        if num_new_tokens:
            self.generation_tokens.inc(num_new_tokens)
            assert stream.first_token_time is not None and stream.last_token_time is not None
            if previous_token_time is None:
                self.ttft.observe(stream.first_token_time - stream.arrival)
            else:
                self.itl.observe(stream.last_token_time - previous_token_time)
        if stream.finished:
            self.e2e.observe(time.monotonic() - stream.arrival)
            self.request_success.labels(self._model_name, stream.finish_reason or "abort").inc()

    def engine_down(self) -> None:
        self.num_requests_running.set(0)
        self.num_requests_waiting.set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
