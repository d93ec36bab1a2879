"""Same-run comparison with a peer server: run orders, per-client figures -> medians over pairs, per-pair ratios,
a markdown table. No servers here: bench/peer_compare.py runs them and hands this module the figures."""

from __future__ import annotations

import statistics
from typing import Any

FIELDS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
LABELS = {"output_tok_s": "output tok/s", "ttft_p50_ms": "TTFT p50 (ms)", "ttft_p99_ms": "TTFT p99 (ms)",
          "tpot_p50_ms": "TPOT p50 (ms)", "tpot_p99_ms": "TPOT p99 (ms)"}  # fmt: skip


def pair_orders(names: tuple[str, str], pairs: int) -> list[list[str]]:
    """Which server goes first flips from pair to pair, so a machine that slows down (or speeds up) over the run
    weighs on both alike instead of always on the second."""
    return [list(names) if i % 2 == 0 else list(reversed(names)) for i in range(pairs)]


def from_vllm_bench(result: dict[str, Any]) -> dict[str, Any]:
    """`vllm bench serve --save-result` JSON -> the figures bench.alternate.summary takes from bench.serve."""
    return {"output_tok_s": result["output_throughput"], "ttft_p50_ms": result["median_ttft_ms"],
            "ttft_p99_ms": result["p99_ttft_ms"], "tpot_p50_ms": result["median_tpot_ms"],
            "tpot_p99_ms": result["p99_tpot_ms"], "completed": result["completed"],
            "failed": result["failed"], "duration_s": result["duration"],
            "total_output_tokens": result["total_output_tokens"]}  # fmt: skip


def summarize_client(ours: list[dict[str, Any]], peer: list[dict[str, Any]]) -> dict[str, Any]:
    """One client's runs, pair by pair: each server's medians over pairs and ours / peer output tok/s per pair.
    The headline is the median of the per-pair ratios: each ratio is taken between runs minutes apart."""
    if len(ours) != len(peer) or not ours:
        raise ValueError(f"need the same, non-zero number of runs on each side, got {len(ours)} and {len(peer)}")
    ratios = [o["output_tok_s"] / p["output_tok_s"] for o, p in zip(ours, peer, strict=True)]
    # Peer's time / ours for the same requests. Where outputs end at EOS (chats) the two servers' greedy answers
    # differ in length, so tok/s also counts how much each wrote; the time to finish the same work does not.
    times = [p["duration_s"] / o["duration_s"] for o, p in zip(ours, peer, strict=True)]

    def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
        return {k: statistics.median(r[k] for r in runs) for k in FIELDS}

    return {"medians": {"ours": medians(ours), "peer": medians(peer)}, "output_tok_s_ratios": ratios,
            "median_ratio": statistics.median(ratios), "time_ratios": times,
            "median_time_ratio": statistics.median(times),
            "failed": {"ours": sum(r["failed"] for r in ours), "peer": sum(r["failed"] for r in peer)}}  # fmt: skip


def markdown_table(runs: dict[str, dict[str, list[dict[str, Any]]]], summaries: dict[str, dict[str, Any]],
                   names: tuple[str, str], labels: dict[str, str]) -> str:  # fmt: skip
    """Rows per client: each server's medians over pairs (tok/s also pair by pair), then ours / peer in tok/s and
    the peer's time over ours for the same requests."""
    ours, peer = names
    head = ["client", "server", *(LABELS[k] for k in FIELDS)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for client, s in summaries.items():
        for side, name in (("ours", ours), ("peer", peer)):
            each = ", ".join(f"{r['output_tok_s']:.0f}" for r in runs[client][name])
            cells = [f"{s['medians'][side]['output_tok_s']:.0f} ({each})"]
            cells += [f"{s['medians'][side][k]:.0f}" for k in FIELDS[1:]]
            lines.append(f"| {labels[client]} | {name} | " + " | ".join(cells) + " |")
        for what, per_pair, median in ((f"{ours} / {peer}", "output_tok_s_ratios", "median_ratio"),
                                       (f"{peer} time / {ours} time", "time_ratios", "median_time_ratio")):
            each = ", ".join(f"{r:.2f}" for r in s[per_pair])
            lines.append(f"| {labels[client]} | {what} | **{s[median]:.2f}x** ({each}) |"
                         + " |" * (len(FIELDS) - 1))  # fmt: skip
    return "\n".join(lines)
