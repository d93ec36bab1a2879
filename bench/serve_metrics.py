"""Serving-benchmark metrics: per-request timings -> TTFT/TPOT/ITL/E2E percentiles, throughput, goodput; table, plot."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

STATS = ("mean", "median", "p90", "p99")
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0  # seconds from send to the first content chunk
    e2e: float = 0.0  # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        # The first token's wait is TTFT's; TPOT spreads the rest over the tokens after it.
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(STATS)
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}  # fmt: skip


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise SystemExit(f"--goodput takes KEY:MS with KEY in {SLO_KEYS}, got {item!r}")
        slos[key] = float(value)
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    measured = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2e}
    return all(measured[k] is None or measured[k] * 1000.0 <= ms for k, ms in slos.items())  # type: ignore[operator]


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    errors = list(dict.fromkeys(r.error for r in results if not r.ok))
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "sent": len(results), "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "goodput": sum(meets_slos(r, slos) for r in ok) / duration if slos else None, "goodput_slos_ms": slos,
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "tpot_ms": stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": stats_ms([gap for r in ok for gap in r.itl]),
        # Content chunks (SSE events with text): fewer than tokens when the server merges tokens into one event.
        "content_chunks": (chunks := sum(len(r.itl) + 1 for r in ok)),
        "tokens_per_chunk": out_tokens / chunks if chunks else None,
        "e2el_ms": stats_ms([r.e2e for r in ok]),
        "first_errors": errors[:5],
    }  # fmt: skip


# ---------------------------------------------------------------- output


def print_run(run: dict[str, Any]) -> None:
    def num(v: float | None, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    print(f"{' Serving benchmark (max concurrency ' + str(run['max_concurrency'] or 'inf') + ') ':=^60}")
    rows = [("Requests sent / completed / failed", f"{run['sent']} / {run['completed']} / {run['failed']}"),
            ("Duration (s)", num(run["duration_s"])), ("Input / output tokens",
            f"{run['total_input_tokens']} / {run['total_output_tokens']}"),
            ("Request throughput (req/s)", num(run["request_throughput"])),
            ("Output token throughput (tok/s)", num(run["output_throughput"])),
            ("Total token throughput (tok/s)", num(run["total_token_throughput"]))]  # fmt: skip
    if run["goodput"] is not None:
        rows.append((f"Goodput (req/s) {run['goodput_slos_ms']}", num(run["goodput"])))
    for label, value in rows:
        print(f"{label:<44}{value:>16}")
    print(f"{'(ms)':<10}" + "".join(f"{s:>12}" for s in STATS))
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        print(f"{key[:-3].upper():<10}" + "".join(f"{num(run[key][s]):>12}" for s in STATS))
    print(f"{'(CPU load average, 1 min, at the end: ' + num(run.get('load_avg_1m')) + ')':>60}")
    for err in run["first_errors"]:
        print(f"error: {err}")
    print("=" * 60)


def plot_runs(runs: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    conc = [r["max_concurrency"] or r["sent"] for r in runs]
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, stat, style in (("ttft_ms", "median", "o-"), ("ttft_ms", "p99", "o--"), ("tpot_ms", "median", "s-"),
                             ("tpot_ms", "p99", "s--")):  # fmt: skip
        lat.plot(conc, [r[key][stat] for r in runs], style, label=f"{key[:-3].upper()} {stat}")
    lat.set(xscale="log", yscale="log", xlabel="max concurrency", ylabel="ms", title="latency")
    thr.plot(conc, [r["output_throughput"] for r in runs], "o-")
    thr.set(xscale="log", xlabel="max concurrency", ylabel="output tok/s", title="output throughput")
    thr.set_ylim(bottom=0)
    for ax in (lat, thr):
        ax.xaxis.set_minor_locator(NullLocator())  # only the measured concurrencies as ticks
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.grid(True, alpha=0.3)
    lat.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
