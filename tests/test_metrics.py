"""The Prometheus names: `roseinfer:` by default, and with --metrics-prefix vllm the names vLLM gives the same series
(vllm/v1/metrics/loggers.py), with its labels but one: vLLM also labels its request series (tokens, latencies,
finished requests) with the engine, where ours are the server's."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from common.messages import SchedulerStats
from frontend.metrics import Metrics
from launch import parse_args

# Sample names vLLM exports for the series both servers have, with their labels (less the request series' engine).
VLLM_SERIES = {
    "vllm:num_requests_running": {"model_name", "engine"},
    "vllm:num_requests_waiting": {"model_name", "engine"},
    "vllm:kv_cache_usage_perc": {"model_name", "engine"},
    "vllm:prefix_cache_queries_total": {"model_name", "engine"},
    "vllm:prefix_cache_hits_total": {"model_name", "engine"},
    "vllm:num_preemptions_total": {"model_name", "engine"},
    "vllm:spec_decode_num_draft_tokens_total": {"model_name", "engine"},
    "vllm:spec_decode_num_accepted_tokens_total": {"model_name", "engine"},
    "vllm:prompt_tokens_total": {"model_name"},
    "vllm:generation_tokens_total": {"model_name"},
    "vllm:time_to_first_token_seconds_bucket": {"model_name", "le"},
    "vllm:inter_token_latency_seconds_bucket": {"model_name", "le"},
    "vllm:e2e_request_latency_seconds_bucket": {"model_name", "le"},
    "vllm:request_success_total": {"model_name", "finished_reason"},
    "vllm:lora_requests_info": {"max_lora", "waiting_lora_adapters", "running_lora_adapters"},
}


def samples(metrics: Metrics) -> dict[str, set[str]]:
    metrics.observe_stats(SchedulerStats(num_running=2, prefix_queries=10, prefix_hits=4))
    metrics.request_success.labels("m", "stop").inc()
    metrics.observe_loras([], max_lora=0)
    text = metrics.render().decode()
    return {s.name: set(s.labels) for family in text_string_to_metric_families(text) for s in family.samples}


def test_vllm_prefix_gives_vllms_names() -> None:
    ours = samples(Metrics("m", lora=True, prefix="vllm"))
    assert {name: ours.get(name) for name in VLLM_SERIES} == VLLM_SERIES
    assert all(name.startswith("vllm:") for name in ours)


def test_default_prefix_is_roseinfer() -> None:
    ours = samples(Metrics("m", lora=True))
    assert {name.replace("roseinfer:", "vllm:", 1) for name in ours} >= set(VLLM_SERIES)
    assert all(name.startswith("roseinfer:") for name in ours)


def test_the_flag() -> None:
    assert parse_args([])[1].metrics_prefix == "roseinfer"
    assert parse_args(["--metrics-prefix", "vllm"])[1].metrics_prefix == "vllm"
