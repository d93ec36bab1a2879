"""Data parallel against one engine, alternating in one run: launch.py with its defaults (one engine, all cores'
threads) and with --data-parallel-size N --num-threads 1 (or what --dp-args says), the same workload against each,
bench.serve's streaming client in this process beside the server.

python -m bench.data_parallel [--pairs 2] [--num-prompts 64 --input-len 128 --output-len 128] [--dtype bfloat16]
    [--dp-size 2] [--dp-args "--num-threads 1"] [--result-json bench/results/data_parallel.json]
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
from bench.compare import free_port, launched  # noqa: E402


def summary(run: dict[str, Any]) -> dict[str, Any]:
    return {"output_tok_s": run["output_throughput"], "ttft_p50_ms": run["ttft_ms"]["median"],
            "ttft_p99_ms": run["ttft_ms"]["p99"], "tpot_p50_ms": run["tpot_ms"]["median"],
            "completed": run["completed"], "failed": run["failed"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_args(parser)
    parser.set_defaults(num_prompts=64, input_len=128, output_len=128, num_warmups=8, disable_tqdm=True)
    parser.add_argument("--pairs", type=int, default=2, help="DP=1, DP=N alternations")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--dp-args", default="--num-threads 1", help="extra launch.py flags of the DP server")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    tokenizer = serve.load_tokenizer(args.tokenizer)
    logs = Path(tempfile.mkdtemp(prefix="roseinfer-dp-"))
    common = ["--dtype", args.dtype, "--log-level", "warning"]
    configs = {"dp1": common, f"dp{args.dp_size}": [*common, "--data-parallel-size", str(args.dp_size),
                                                    *shlex.split(args.dp_args)]}  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for pair in range(args.pairs):
        for name, flags in configs.items():
            port = free_port()
            cmd = [sys.executable, "launch.py", "--port", str(port), *flags]
            print(f"--- pair {pair + 1}, {name}: {' '.join(cmd[1:])}", flush=True)
            with launched(cmd, port, logs / f"{name}-{pair}.log") as url:
                args.base_url, args.model = url, None
                args.seed = pair  # both configurations of a pair see the same prompts
                result = asyncio.run(serve.benchmark(args, tokenizer))
            runs[name].append(summary(result["runs"][0]) | {"command": " ".join(cmd[1:])})
    means = {name: {key: statistics.mean(r[key] for r in rs) for key in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
                                                                         "tpot_p50_ms")}
             for name, rs in runs.items()}  # fmt: skip
    print(f"{'':<8}{'output tok/s':>14}{'TTFT p50 ms':>14}{'TTFT p99 ms':>14}{'TPOT p50 ms':>14}")
    for name, rs in runs.items():
        for i, r in enumerate(rs):
            print(f"{name + ' #' + str(i + 1):<8}{r['output_tok_s']:>14.1f}{r['ttft_p50_ms']:>14.0f}"
                  f"{r['ttft_p99_ms']:>14.0f}{r['tpot_p50_ms']:>14.1f}")  # fmt: skip
    if args.result_json:
        settings = {k: v for k, v in vars(args).items() if k not in ("base_url", "model")}
        settings["machine"] = serve.machine()
        with open(args.result_json, "w") as f:
            json.dump({"settings": settings, "configs": configs, "runs": runs, "means": means}, f, indent=2)


if __name__ == "__main__":
    main()
