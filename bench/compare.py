"""One serving workload against several servers this script starts itself, one after the other: roseinfer
(launch.py) and transformers `generate` behind bench/hf_server.py; prints the ratios and writes JSON.

python -m bench.compare [--servers roseinfer,hf] [--num-prompts 32 --input-len 128 --output-len 64]
    [--max-concurrency 8 | --sweep-concurrency 1,8] [--dtype bfloat16] [--hf-batch-size N] [--result-json F]

With `--peer vllm` the peer is vLLM's CPU build from its own venv instead, and with `--peer llama.cpp` llama.cpp's
`llama-server` on the same GGUF, each measured in alternating pairs with three clients (bench.serve, `vllm bench
serve`, chat conversations); bench/peer_compare.py runs them and lists their flags:

python -m bench.compare --peer vllm [--pairs 3] [--vllm-venv ~/.cache/peers/vllm] [--peers-dir ../shared/peers]
    [--clients serve,vllm,chat] [--result-json bench/results/compare_vllm.json]
python -m bench.compare --peer llama.cpp [--llama-server ~/.cache/peers/llama.cpp/bin/llama-server] [--gguf FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

if not __package__:  # run as a file (python bench/x.py), not with -m: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import peer_compare, serve  # noqa: E402
from bench.servers import free_port, launched  # noqa: E402


def server_command(name: str, port: int, args: argparse.Namespace) -> list[str]:
    if name == "roseinfer":
        return [sys.executable, "launch.py", "--port", str(port), "--dtype", args.dtype, "--log-level", "warning",
                *shlex.split(args.roseinfer_args)]  # fmt: skip
    if name == "hf":
        batch = args.hf_batch_size or args.max_concurrency or 8
        return [sys.executable, "-m", "bench.hf_server", "--port", str(port), "--dtype", args.dtype,
                "--batch-size", str(batch)]  # fmt: skip
    raise SystemExit(f"unknown server {name!r} (roseinfer, hf)")


def ratios(ours: dict[str, Any], ref: dict[str, Any]) -> dict[str, float | None]:
    """ours / reference: above 1 is better for throughput, below 1 is better for latency."""

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {"output_throughput": div(ours["output_throughput"], ref["output_throughput"]),
            "ttft_p50": div(ours["ttft_ms"]["median"], ref["ttft_ms"]["median"]),
            "tpot_p50": div(ours["tpot_ms"]["median"], ref["tpot_ms"]["median"])}  # fmt: skip


def print_comparison(names: list[str], runs: dict[str, list[dict[str, Any]]], table: list[dict[str, Any]]) -> None:
    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for i, entry in enumerate(table):
        print(f"{' comparison, max concurrency ' + str(entry['max_concurrency'] or 'inf') + ' ':=^72}")
        print(f"{'':<18}" + "".join(f"{n:>14}" for n in names) + f"{names[0] + ' / ' + names[-1]:>26}")
        for label, get, key in (("output tok/s", lambda r: r["output_throughput"], "output_throughput"),
                                ("TTFT p50 (ms)", lambda r: r["ttft_ms"]["median"], "ttft_p50"),
                                ("TPOT p50 (ms)", lambda r: r["tpot_ms"]["median"], "tpot_p50"),
                                ("failed", lambda r: r["failed"], None)):  # fmt: skip
            cells = "".join(f"{num(get(runs[n][i]), '.1f'):>14}" for n in names)
            ratio = num(entry["ratios"].get(key) if key else None, ".2f") + ("x" if key else "")
            print(f"{label:<18}{cells}{ratio:>26}")
    print("=" * 72)


def main() -> None:
    peer = argparse.ArgumentParser(add_help=False)
    peer.add_argument("--peer", choices=["hf", *peer_compare.PEERS], default="hf")
    if peer.parse_known_args()[0].peer != "hf":  # its own flags and defaults (W, pairs): bench/peer_compare.py
        return peer_compare.main()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_args(parser)
    parser.add_argument("--peer", choices=["hf", *peer_compare.PEERS], default="hf",
                        help="vllm, llama.cpp: see bench/peer_compare.py --help")
    parser.set_defaults(num_prompts=32, output_len=64, max_concurrency=8, disable_tqdm=False)
    parser.add_argument("--servers", default="roseinfer,hf", help="comma-separated, in run order")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="both servers")
    parser.add_argument("--roseinfer-args", default="", help="extra launch.py flags, one string")
    parser.add_argument("--hf-batch-size", type=int, default=None, help="default: --max-concurrency")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    args.endpoint = "/v1/completions"  # the reference server serves only this
    names = args.servers.split(",")
    tokenizer = serve.load_tokenizer(args.tokenizer)
    runs: dict[str, list[dict[str, Any]]] = {}
    logs = Path(tempfile.mkdtemp(prefix="roseinfer-compare-"))
    settings: dict[str, Any] = {}
    for name in names:
        port = free_port()
        print(f"--- {name}: starting {' '.join(server_command(name, port, args)[1:])}", flush=True)
        with launched(server_command(name, port, args), port, logs / f"{name}.log") as url:
            args.base_url, args.model = url, None  # each server names its model itself
            result = asyncio.run(serve.benchmark(args, tokenizer))
        runs[name], settings = result["runs"], result["settings"]
    table = [{"max_concurrency": run["max_concurrency"], "ratios": ratios(run, runs[names[-1]][i])}
             for i, run in enumerate(runs[names[0]])]  # fmt: skip
    print_comparison(names, runs, table)
    settings.pop("base_url", None)
    settings["server_commands"] = {n: server_command(n, 0, args)[1:] for n in names}
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"settings": settings, "servers": runs, "ratios": table}, f, indent=2)


if __name__ == "__main__":
    main()
