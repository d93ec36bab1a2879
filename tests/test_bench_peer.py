"""bench/peer_report.py: a real `vllm bench serve` result parsed, pair orders, medians and ratios over pairs, the
table; bench/peer_compare.py's llama-server command. No server starts here (no peer is a dependency of the
project)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.peer_compare import add_args, names, server_command
from bench.peer_report import from_vllm_bench, markdown_table, pair_orders, summarize_client

# Saved from `vllm bench serve` 0.32.0 (vllm_bench_client.sh, 4 prompts) against vLLM CPU on the default model.
SAMPLE = Path(__file__).parent / "data" / "vllm_bench_serve_result.json"


def fig(tok_s: float, ttft: float = 100.0, failed: int = 0, duration: float = 1.0) -> dict:
    return {"output_tok_s": tok_s, "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft, "tpot_p50_ms": 10.0,
            "tpot_p99_ms": 20.0, "failed": failed, "duration_s": duration}  # fmt: skip


def test_vllm_result_parsed() -> None:
    raw = json.loads(SAMPLE.read_text())
    got = from_vllm_bench(raw)
    assert got["output_tok_s"] == raw["output_throughput"] and got["total_output_tokens"] == 4 * 128
    assert (got["completed"], got["failed"]) == (4, 0)
    assert got["ttft_p50_ms"] == raw["median_ttft_ms"] <= got["ttft_p99_ms"] == raw["p99_ttft_ms"]
    assert got["tpot_p50_ms"] == raw["median_tpot_ms"] <= got["tpot_p99_ms"] == raw["p99_tpot_ms"]
    # vLLM's own throughput is its output tokens over its duration: the fields mean what we read them as.
    assert got["output_tok_s"] == pytest.approx(raw["total_output_tokens"] / raw["duration"])


def test_pair_orders_alternate() -> None:
    assert pair_orders(("a", "b"), 3) == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert pair_orders(("a", "b"), 1) == [["a", "b"]]


def test_median_of_per_pair_ratios() -> None:
    # Pair 2 ran on a slow machine for both servers: per-pair ratios cancel that, a ratio of medians would not.
    ours = [fig(110.0, duration=2.0), fig(55.0, ttft=300.0, duration=4.0), fig(120.0, failed=1, duration=2.0)]
    peer = [fig(100.0, duration=2.5), fig(50.0, duration=4.0), fig(80.0, duration=2.0)]
    s = summarize_client(ours, peer)
    assert s["output_tok_s_ratios"] == pytest.approx([1.1, 1.1, 1.5]) and s["median_ratio"] == pytest.approx(1.1)
    # The time to finish the same requests, peer over ours: pair 3 wrote more tokens in the same time.
    assert s["time_ratios"] == pytest.approx([1.25, 1.0, 1.0]) and s["median_time_ratio"] == pytest.approx(1.0)
    assert s["medians"]["ours"]["output_tok_s"] == 110.0 and s["medians"]["peer"]["output_tok_s"] == 80.0
    assert s["medians"]["ours"]["ttft_p50_ms"] == 100.0 and s["medians"]["ours"]["ttft_p99_ms"] == 200.0
    assert s["failed"] == {"ours": 1, "peer": 0}
    assert summarize_client([fig(3.0), fig(1.0)], [fig(1.0), fig(1.0)])["median_ratio"] == 2.0  # even: the mean
    with pytest.raises(ValueError):
        summarize_client([fig(1.0)], [fig(1.0), fig(1.0)])

    runs = {"w": {"rose": ours, "peer": peer}}
    table = markdown_table(runs, {"w": s}, ("rose", "peer"), {"w": "client W"}).splitlines()
    assert len(table) == 2 + 4 and all(line.count("|") == 8 for line in table)
    assert table[2].startswith("| client W | rose | 110 (110, 55, 120) | 100 | 200 |")
    assert table[4].startswith("| client W | rose / peer | **1.10x** (1.10, 1.10, 1.50) |")
    assert table[5].startswith("| client W | peer time / rose time | **1.00x** (1.25, 1.00, 1.00) |")


def test_llama_server_command_takes_every_request_at_once() -> None:
    # llama-server runs as many requests at once as it has slots (-np), each with -c / -np tokens of KV: the peer must
    # get a slot for every request a client sends at once, or its figures would measure a queue we did not make.
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--peer", "llama.cpp", "--gguf", "/m.gguf", "--llama-args", "--temp 0"])
    assert names(args) == ("roseinfer", "llama.cpp")
    cmd = server_command("llama.cpp", 8123, args)
    flag = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1) if cmd[i].startswith("-")}
    assert (flag["-m"], flag["--port"], flag["-np"], flag["-c"]) == ("/m.gguf", "8123", "64", "32768")
    assert cmd[-2:] == ["--temp", "0"] and "-kvu" not in cmd
    one_stream = parser.parse_args(["--peer", "llama.cpp", "--max-concurrency", "1", "--chat-prompts", "4"])
    cmd = server_command("llama.cpp", 1, one_stream)
    assert cmd[cmd.index("-np") + 1] == "4"  # one stream of W, or 4 chats at once
