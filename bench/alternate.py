"""Servers measured one after the other, alternating, in one run: each a launch.py command line (from this checkout
or another, e.g. a worktree of an earlier commit), the same workload against each, bench.serve's streaming client
in this process beside the server. Every ratio it prints is between figures of the same run.

python -m bench.alternate --server NAME=[DIR::]FLAGS [--server ...] [--pairs 3] [--num-prompts 64 --input-len 128
    --output-len 128] [--result-json bench/results/x.json]

  e.g. a commit against the working tree (W = 64 x 128 in x 128 out, all at once):
  git worktree add /tmp/before <commit> && python -m bench.alternate --pairs 3 \\
      --server "before=/tmp/before::--dtype bfloat16" --server "after=--dtype bfloat16"

Servers here are launch.py checkouts; roseinfer against vLLM (its own venv, its own client too) alternates the same
way in `python -m bench.compare --peer vllm` (bench/peer_compare.py), which reuses summary() and bench/servers.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

if not __package__:  # run as a file (python bench/x.py), not with -m: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import serve  # noqa: E402
from bench.servers import REPO, free_port, launched  # noqa: E402

KEYS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")


def summary(run: dict[str, Any]) -> dict[str, Any]:
    return {"output_tok_s": run["output_throughput"], "ttft_p50_ms": run["ttft_ms"]["median"],
            "ttft_p99_ms": run["ttft_ms"]["p99"], "tpot_p50_ms": run["tpot_ms"]["median"],
            "tpot_p99_ms": run["tpot_ms"]["p99"], "completed": run["completed"], "failed": run["failed"]}  # fmt: skip


def add_args(parser: argparse.ArgumentParser) -> None:
    serve.add_args(parser)
    parser.set_defaults(num_prompts=64, input_len=128, output_len=128, num_warmups=8, disable_tqdm=True)
    parser.add_argument("--pairs", type=int, default=2, help="rounds; each runs every server once, in order")
    parser.add_argument("--result-json", default=None)


def alternate(servers: dict[str, tuple[Path, list[str]]], args: argparse.Namespace) -> dict[str, Any]:
    """Runs every server (checkout, launch.py flags) once per round; prints and returns the figures and medians."""
    tokenizer = serve.load_tokenizer(args.tokenizer)
    logs = Path(tempfile.mkdtemp(prefix="roseinfer-alternate-"))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    for rnd in range(args.pairs):
        for name, (checkout, flags) in servers.items():
            port = free_port()
            cmd = [sys.executable, str(checkout / "launch.py"), "--port", str(port), *flags]
            print(f"--- round {rnd + 1}, {name}: {' '.join(cmd[1:])}", flush=True)
            # In its own checkout: before common/python_command.py, launch.py started engines that imported
            # the working directory's engine_core.
            with launched(cmd, port, logs / f"{name}-{rnd}.log", cwd=checkout) as url:
                args.base_url, args.model = url, None
                args.seed = rnd  # every server of a round sees the same prompts
                result = asyncio.run(serve.benchmark(args, tokenizer))
            runs[name].append(summary(result["runs"][0]) | {"command": " ".join(cmd[1:])})
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in KEYS} for name, rs in runs.items()}
    print(f"{'':<12}{'output tok/s':>14}{'TTFT p50 ms':>14}{'TTFT p99 ms':>14}{'TPOT p50 ms':>14}")
    for name, rs in runs.items():
        for i, r in enumerate(rs):
            print(f"{name + ' #' + str(i + 1):<12}" + "".join(f"{r[k]:>14.1f}" for k in KEYS))
        print(f"{name + ' median':<12}" + "".join(f"{medians[name][k]:>14.1f}" for k in KEYS))
    first = next(iter(servers))
    for name in servers:
        ratio = medians[name]["output_tok_s"] / medians[first]["output_tok_s"]
        print(f"{name} / {first}, median output tok/s: {ratio:.3f}")
    out = {"configs": {n: {"checkout": str(c), "flags": f} for n, (c, f) in servers.items()}, "runs": runs,
           "medians": medians}  # fmt: skip
    if args.result_json:
        settings = {k: v for k, v in vars(args).items() if k not in ("base_url", "model", "server")}
        settings["machine"] = serve.machine()
        with open(args.result_json, "w") as f:
            json.dump({"settings": settings, **out}, f, indent=2)
    return out


def parse_server(text: str) -> tuple[str, tuple[Path, list[str]]]:
    name, _, rest = text.partition("=")
    checkout, sep, flags = rest.partition("::")
    if not sep:
        checkout, flags = str(REPO), rest
    return name, (Path(checkout).resolve(), shlex.split(flags))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    parser.add_argument("--server", action="append", required=True, help="NAME=[CHECKOUT::]LAUNCH_FLAGS")
    args = parser.parse_args()
    alternate(dict(parse_server(s) for s in args.server), args)


if __name__ == "__main__":
    main()
