"""Prometheus metrics of the API process, named like vLLM's with the `roseinfer:` prefix (`vllm:` with
--metrics-prefix vllm: then the series vLLM also has carry its names; its request series also carry an `engine`
label, ours the model's only)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from common.messages import SchedulerStats
from frontend.engine.request_stream import RequestStream


class EngineTotals(NamedTuple):
    prompt_tokens: float  # counters: totals since the server started
    generation_tokens: float
    running: int  # gauges: now
    waiting: int
    kv_usage: float  # 0-1
    prefix_queries: float
    prefix_hits: float
    draft_tokens: float
    accepted_tokens: float


_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                    80.0, 160.0)  # fmt: skip


class Metrics:
    """One registry per app (tests create several apps in one process). Series about one engine core's scheduler
    carry an `engine` label (its data-parallel index); request series are the server's."""

    def __init__(self, model_name: str, num_engines: int = 1, lora: bool = False, prefix: str = "roseinfer") -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        engines = [str(i) for i in range(num_engines)]

        def per_engine(kind: type[Gauge] | type[Counter], name: str, doc: str) -> list:
            metric = kind(f"{prefix}:{name}", doc, ["model_name", "engine"], registry=r)
            return [metric.labels(model_name, e) for e in engines]  # every engine's series exists from the start

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{prefix}:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.num_requests_running = per_engine(Gauge, "num_requests_running", "Requests in the engine's running batch")
        self.num_requests_waiting = per_engine(Gauge, "num_requests_waiting", "Requests waiting in the engine")
        self.kv_cache_usage_perc = per_engine(Gauge, "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)")
        self.kv_cache_blocks_in_use = per_engine(Gauge, "kv_cache_blocks_in_use", "KV cache blocks held by requests")
        self.prefix_cache_queries = per_engine(Counter, "prefix_cache_queries",
                                               "Prompt tokens looked up in the prefix cache")  # fmt: skip
        self.prefix_cache_hits = per_engine(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.num_preemptions = per_engine(Counter, "num_preemptions", "Requests preempted by the scheduler")
        self.spec_decode_draft_tokens = per_engine(Counter, "spec_decode_num_draft_tokens",
                                                   "Speculative tokens proposed (--speculative-config)")  # fmt: skip
        self.spec_decode_accepted_tokens = per_engine(Counter, "spec_decode_num_accepted_tokens",
                                                      "Speculative tokens the model agreed with")  # fmt: skip
        self.generation_tokens_by_engine = per_engine(Counter, "engine_generation_tokens", "Tokens generated")
        self.prompt_tokens_by_engine = per_engine(Counter, "engine_prompt_tokens", "Prompt tokens sent to the engine")
        self.engine_restarts = per_engine(Counter, "engine_restarts", "Engine core restarts after a crash or a hang")
        self.lora_adapters_loaded = per_engine(Gauge, "lora_adapters_loaded",
                                               "LoRA adapters whose weights the engine holds")  # fmt: skip
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens sent to the engine")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between two outputs of one request")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last output")
        self.request_success = Counter(f"{prefix}:request_success", "Finished requests by finish reason",
                                       ["model_name", "finished_reason"], registry=r)  # fmt: skip
        # vLLM's vllm:lora_requests_info, which inference gateways read for LoRA affinity (with --enable-lora only).
        self.lora_requests_info = Gauge(
            f"{prefix}:lora_requests_info", "LoRA adapters of the requests in flight (the labels, comma-separated) "
            "and when they were counted (the value)", ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=r,
        ) if lora else None  # fmt: skip
        self._model_name = model_name
        self._prefix = prefix
        self._last = [SchedulerStats() for _ in engines]

    def observe_stats(self, stats: SchedulerStats, engine: int = 0) -> None:
        self.num_requests_running[engine].set(stats.num_running)
        self.num_requests_waiting[engine].set(stats.num_waiting)
        self.kv_cache_usage_perc[engine].set(stats.kv_usage)
        self.kv_cache_blocks_in_use[engine].set(stats.num_blocks_in_use)
        self.lora_adapters_loaded[engine].set(stats.num_loras)
        # The engine reports running totals; a restarted engine starts again from zero.
        last = self._last[engine]
        for counter, now, before in (
            (self.prefix_cache_queries[engine], stats.prefix_queries, last.prefix_queries),
            (self.prefix_cache_hits[engine], stats.prefix_hits, last.prefix_hits),
            (self.num_preemptions[engine], stats.num_preempted, last.num_preempted),
            (self.spec_decode_draft_tokens[engine], stats.num_draft_tokens, last.num_draft_tokens),
            (self.spec_decode_accepted_tokens[engine], stats.num_accepted_tokens, last.num_accepted_tokens),
        ):
            counter.inc(now - before if now >= before else now)
        self._last[engine] = stats

    def observe_output(self, stream: RequestStream, num_new_tokens: int, previous_token_time: float | None) -> None:
        """One request's output of a step: its latencies (the token counters go once per step: observe_generated)."""
        if num_new_tokens:
            assert stream.first_token_time is not None and stream.last_token_time is not None
            if previous_token_time is None:
                self.ttft.observe(stream.first_token_time - stream.arrival)
            else:
                self.itl.observe(stream.last_token_time - previous_token_time)
        if stream.finished:
            self.e2e.observe(time.monotonic() - stream.arrival)
            self.request_success.labels(self._model_name, stream.finish_reason or "abort").inc()

    def observe_prompt(self, num_tokens: int, engine: int = 0) -> None:
        self.prompt_tokens.inc(num_tokens)
        self.prompt_tokens_by_engine[engine].inc(num_tokens)

    def observe_generated(self, num_tokens: int, engine: int = 0) -> None:
        if num_tokens:
            self.generation_tokens.inc(num_tokens)
            self.generation_tokens_by_engine[engine].inc(num_tokens)

    def observe_loras(self, streams: Iterable[RequestStream], max_lora: int) -> None:
        """The adapters with a request admitted into a step (running) and with one not yet admitted (waiting), in
        order of first sight; max_lora: how many adapters are loaded (each can run in any step). One series at a
        time: vLLM keeps every label set it ever reported, and gateways read only the newest."""
        if self.lora_requests_info is None:
            return
        running: dict[str, None] = {}
        waiting: dict[str, None] = {}
        for stream in streams:
            if (lora := stream.request.lora) is not None and not stream.finished:
                (running if stream.started else waiting)[lora.name] = None
        self.lora_requests_info.clear()
        self.lora_requests_info.labels(str(max_lora), ",".join(waiting), ",".join(running)).set(time.time())

    def engine_down(self, engine: int = 0) -> None:
        self.num_requests_running[engine].set(0)
        self.num_requests_waiting[engine].set(0)

    def engine_totals(self, engine: int) -> EngineTotals:
        """Where engine `engine` stands now, read back from the series (the periodic stats line's source)."""

        def value(name: str) -> float:
            labels = {"model_name": self._model_name, "engine": str(engine)}
            return self.registry.get_sample_value(f"{self._prefix}:{name}", labels) or 0.0

        return EngineTotals(value("engine_prompt_tokens_total"), value("engine_generation_tokens_total"),
                            int(value("num_requests_running")), int(value("num_requests_waiting")),
                            value("kv_cache_usage_perc"), value("prefix_cache_queries_total"),
                            value("prefix_cache_hits_total"), value("spec_decode_num_draft_tokens_total"),
                            value("spec_decode_num_accepted_tokens_total"))  # fmt: skip

    def render(self) -> bytes:
        return generate_latest(self.registry)
