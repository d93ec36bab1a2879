"""roseinfer against a peer server, same model, same clients, same run: vLLM's CPU build (`python -m bench.compare
--peer vllm`) or llama.cpp's `llama-server` (`--peer llama.cpp`), which serves the GGUF file itself (by default the
default model's, whose converted copy roseinfer serves).

Each pair starts both servers one after the other (which goes first flips from pair to pair), and runs every client
against each before stopping it: (serve) bench.serve's streaming client in this process on W = N random-token
prompts x input-len x output-len, ignore_eos, all at once; (vllm) vLLM's own `vllm bench serve` on W through
<peers-dir>/vllm_bench_client.sh (its prompt and output lengths are 128, fixed by the script); (chat) bench.serve
on --chat-prompts conversations of bench/data/conversations.jsonl at once, /v1/chat/completions. No peer is a
dependency of this project: vLLM runs from its own venv (<peers-dir>/setup_vllm_cpu.sh installs one, and its client
serves against either peer), llama-server is built by bench/setup_llamacpp.sh.

python -m bench.compare --peer vllm [--pairs 3] [--clients serve,vllm,chat] [--vllm-venv ~/.cache/peers/vllm]
    [--peers-dir ../shared/peers] [--model-dir HF_DIR] [--num-prompts 64 --input-len 128 --output-len 128]
    [--chat-prompts 16] [--result-json bench/results/compare_vllm.json]
python -m bench.compare --peer llama.cpp [--llama-server ~/.cache/peers/llama.cpp/bin/llama-server] [--gguf FILE]
    [--llama-slots 64] [--llama-ctx 32768] [...the flags above]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file (python bench/x.py), not with -m: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import serve  # noqa: E402
from bench.alternate import summary  # noqa: E402
from bench.peer_report import from_vllm_bench, markdown_table, pair_orders, summarize_client  # noqa: E402
from bench.servers import REPO, free_port, launched, served_model, tail  # noqa: E402

PEERS = {"vllm": "vLLM", "llama.cpp": "llama.cpp"}  # --peer -> the name results give it
CLIENTS = ("serve", "vllm", "chat")
LABELS = {"serve": "bench.serve, W", "vllm": "vllm bench serve, W", "chat": "bench.serve, chat"}


def add_args(parser: argparse.ArgumentParser) -> None:
    serve.add_args(parser)
    parser.set_defaults(num_prompts=64, input_len=128, output_len=128, num_warmups=8, disable_tqdm=True)
    a = parser.add_argument
    a("--peer", choices=list(PEERS), default="vllm", help="the peer server (bench.compare without it: transformers)")
    a("--pairs", type=int, default=3, help="rounds; each starts both servers once, the first one alternating")
    a("--clients", default=",".join(CLIENTS), help=f"comma-separated subset of {','.join(CLIENTS)}")
    a("--vllm-venv", default=os.environ.get("VLLM_VENV", "~/.cache/peers/vllm"), help="default: $VLLM_VENV or this")
    a("--peers-dir", default=str(REPO.parent / "shared" / "peers"), help="serve_vllm_cpu.sh and its siblings")
    a("--model-dir", default=None, help="HF model dir both serve (default: the default model's converted copy)")
    a("--chat-dataset", default=str(REPO / "bench" / "data" / "conversations.jsonl"))
    a("--chat-prompts", type=int, default=16, help="chat requests of the chat client, all sent at once")
    a("--roseinfer-args", default="", help="extra launch.py flags, one string")
    a("--served-model", default=None, help="the model the clients ask for (default: the first each server lists), "
      "e.g. a LoRA adapter both servers load (their flags: --roseinfer-args, and a copy of serve_vllm_cpu.sh)")
    a("--llama-server", default="~/.cache/peers/llama.cpp/bin/llama-server", help="bench/setup_llamacpp.sh builds it")
    a("--gguf", default=None, help="the file llama-server serves (default: the default model's GGUF, whose "
      "converted copy is roseinfer's default --model-dir)")
    a("--llama-slots", type=int, default=None, help="llama-server's -np, requests it runs at once (default: the most "
      "any client sends at once)")
    a("--llama-ctx", type=int, default=32768, help="llama-server's -c: KV cache tokens, split evenly over the slots "
      "(its one pool for all, -kvu, halved its rate on W: each step attended over every slot's cells)")
    a("--llama-args", default="", help="more llama-server flags, one string")
    a("--launch-timeout", type=float, default=900.0, help="seconds for a server to answer /health")
    a("--result-json", default=None, help="default: bench/results/compare_<peer>.json")


def names(args: argparse.Namespace) -> tuple[str, str]:
    return "roseinfer", PEERS[args.peer]


def server_command(name: str, port: int | str, args: argparse.Namespace) -> list[str]:
    if name == "vLLM":
        return [str(args.peers_dir / "serve_vllm_cpu.sh"), str(args.model_dir), str(port), str(args.vllm_venv)]
    if name == "llama.cpp":  # all cores, as ours
        slots = args.llama_slots or max(args.max_concurrency or args.num_prompts, args.chat_prompts)
        return [str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
                "-t", str(os.cpu_count()), "-tb", str(os.cpu_count()), "-np", str(slots), "-c", str(args.llama_ctx),
                "--no-webui", *shlex.split(args.llama_args)]  # fmt: skip
    return [sys.executable, "launch.py", "--port", str(port), "--model", str(args.model_dir), "--dtype", "bfloat16",
            "--log-level", "warning", *shlex.split(args.roseinfer_args)]  # fmt: skip


def serve_client(client: str, args: argparse.Namespace, url: str, model: str, pair: int, tokenizer: Any) -> dict:
    run = argparse.Namespace(**vars(args))
    run.base_url, run.model, run.seed, run.sweep_concurrency = url, model, pair, None  # a pair's servers: same prompts
    run.tokenizer = str(args.model_dir)
    if client == "chat":  # real conversations stop where the model ends them: no ignore_eos
        run.endpoint, run.dataset_path, run.num_prompts = "/v1/chat/completions", args.chat_dataset, args.chat_prompts
        run.ignore_eos, run.max_concurrency, run.num_warmups = False, None, 1
    else:
        run.endpoint, run.dataset_path, run.ignore_eos = "/v1/completions", None, True
    result = asyncio.run(serve.benchmark(run, tokenizer))["runs"][0]
    return summary(result) | {k: result[k] for k in ("duration_s", "total_output_tokens", "load_avg_1m")}


def vllm_client(args: argparse.Namespace, url: str, model: str, out: Path) -> dict[str, Any]:
    cmd = [str(args.peers_dir / "vllm_bench_client.sh"), url, model, str(args.model_dir), str(out),
           str(args.num_prompts), *([str(args.max_concurrency)] if args.max_concurrency else [])]  # fmt: skip
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        proc = subprocess.run(cmd, env={**os.environ, "VLLM_VENV": str(args.vllm_venv)}, stdout=f,
                              stderr=subprocess.STDOUT, timeout=args.timeout * 2, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited with {proc.returncode}; log: {log}\n{tail(log)}")
    raw = json.loads(out.read_text())
    print(f"vllm bench serve: {raw['output_throughput']:.1f} output tok/s, TTFT p50 {raw['median_ttft_ms']:.0f} ms, "
          f"TPOT p50 {raw['median_tpot_ms']:.1f} ms", flush=True)  # fmt: skip
    return from_vllm_bench(raw) | {"load_avg_1m": os.getloadavg()[0]}


def _stdout(cmd: list[str], stream: str = "stdout") -> str:
    """What cmd prints on `stream` (llama-server prints its version on stderr)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO)
    return getattr(proc, stream).strip() if proc.returncode == 0 else f"unknown ({proc.stderr.strip()[-200:]})"


def peer_versions(args: argparse.Namespace) -> dict[str, str]:
    if args.peer == "llama.cpp":
        version = _stdout([str(args.llama_server), "--version"], "stderr").replace("\n", "; ")
        return {"llama.cpp": f"llama.cpp {version}", "gguf": str(args.gguf)}
    venv_python = str(args.vllm_venv / "bin" / "python")
    return {"vllm": _stdout([venv_python, str(args.peers_dir / "vllm_cli.py"), "--version"]),
            "vllm_torch": _stdout([venv_python, "-c", "import torch; print(torch.__version__)"])}


def settings(args: argparse.Namespace, clients: list[str]) -> dict[str, Any]:
    commit = _stdout(["git", "rev-parse", "HEAD"])
    dirty = _stdout(["git", "status", "--porcelain", "--untracked-files=no"]) != ""
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": serve.machine() | {"nproc": os.cpu_count(), "load_avg_1m_at_start": os.getloadavg()[0]},
        "versions": {**peer_versions(args), "torch": importlib.metadata.version("torch"),
                     "roseinfer_commit": commit + (" (uncommitted edits)" if dirty else "")},  # fmt: skip
        "model_dir": str(args.model_dir), "served_model": args.served_model, "pairs": args.pairs, "clients": clients,
        "orders": pair_orders(names(args), args.pairs),
        "server_commands": {n: server_command(n, "PORT", args) for n in names(args)},
        "workload_w": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                       "prefix_len": args.prefix_len, "range_ratio": args.range_ratio, "ignore_eos": True,
                       "max_concurrency": args.max_concurrency, "num_warmups": args.num_warmups,
                       "vllm_client_lengths": "128 in, 128 out (fixed by vllm_bench_client.sh)"},  # fmt: skip
        "workload_chat": {"dataset": os.path.relpath(args.chat_dataset, REPO), "num_prompts": args.chat_prompts,
                          "max_concurrency": None, "output_len_default": args.output_len, "ignore_eos": False},
    }  # fmt: skip


def compare(args: argparse.Namespace) -> dict[str, Any]:
    args.peers_dir = Path(args.peers_dir).expanduser().resolve()
    args.vllm_venv = Path(args.vllm_venv).expanduser()
    clients = args.clients.split(",")
    if unknown := set(clients) - set(CLIENTS):
        raise SystemExit(f"--clients: unknown {sorted(unknown)}, choose from {CLIENTS}")
    args.llama_server = Path(args.llama_server).expanduser()
    have_vllm = (args.vllm_venv / "bin" / "python").exists()
    if args.peer == "vllm" and not have_vllm:
        raise SystemExit(f"no vLLM venv at {args.vllm_venv}: run {args.peers_dir / 'setup_vllm_cpu.sh'} first")
    if args.peer == "vllm" and not (args.peers_dir / "serve_vllm_cpu.sh").exists():
        raise SystemExit(f"no serve_vllm_cpu.sh in {args.peers_dir} (--peers-dir)")
    if args.peer == "llama.cpp" and not args.llama_server.exists():
        raise SystemExit(f"no llama-server at {args.llama_server}: run bench/setup_llamacpp.sh first")
    if "vllm" in clients and not (have_vllm and (args.peers_dir / "vllm_bench_client.sh").exists()):
        print(f"no vLLM venv or vllm_bench_client.sh in {args.peers_dir}: running without vLLM's client", flush=True)
        clients.remove("vllm")
    from common.model_source import _default_gguf, resolve_model

    args.model_dir = Path(args.model_dir).resolve() if args.model_dir else resolve_model(None).path
    args.gguf = Path(args.gguf).resolve() if args.gguf else Path(str(_default_gguf()))
    args.result_json = args.result_json or str(REPO / "bench" / "results" / f"compare_{args.peer}.json")
    ours, peer = names(args)
    tokenizer = serve.load_tokenizer(str(args.model_dir))
    logs = Path(tempfile.mkdtemp(prefix=f"roseinfer-vs-{args.peer}-"))
    out: dict[str, Any] = {"settings": settings(args, clients),
                           "runs": {c: {n: [] for n in names(args)} for c in clients}}
    print(f"logs and vllm bench results: {logs}", flush=True)
    for pair, order in enumerate(out["settings"]["orders"]):
        for name in order:
            port = free_port()
            cmd = server_command(name, port, args)
            print(f"--- pair {pair + 1}/{args.pairs}, {name}: {shlex.join(cmd)}", flush=True)
            started = time.monotonic()
            with launched(cmd, port, logs / f"{name}-{pair}.log", timeout=args.launch_timeout) as url:
                ready_s, model = time.monotonic() - started, args.served_model or served_model(url)
                for client in clients:
                    if client == "vllm":
                        fig = vllm_client(args, url, model, logs / f"vllm-bench-{name}-{pair}.json")
                    else:
                        fig = serve_client(client, args, url, model, pair, tokenizer)
                    out["runs"][client][name].append(fig | {"pair": pair, "went_first": order[0] == name,
                                                            "server_ready_s": ready_s})  # fmt: skip
            _write(args.result_json, out)  # a run cut short still leaves every finished pair's figures
    out["summary"] = {c: summarize_client(out["runs"][c][ours], out["runs"][c][peer]) for c in clients}
    out["markdown"] = markdown_table(out["runs"], out["summary"], (ours, peer), LABELS)
    _write(args.result_json, out)
    print(f"\n{next(iter(out['settings']['versions'].values()))}, torch {out['settings']['versions']['torch']}, "
          f"{out['settings']['machine']['nproc']} CPUs ({out['settings']['machine']['processor']}), "
          f"{args.pairs} pair(s), medians over pairs; {args.result_json}\n")  # fmt: skip
    print(out["markdown"])
    for client, s in out["summary"].items():
        print(f"{LABELS[client]}: {ours} / {peer} output tok/s, median over pairs {s['median_ratio']:.3f}; "
              f"{peer}'s time / {ours}'s for the same requests {s['median_time_ratio']:.3f}")
    return out


def _write(path: str | None, out: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    compare(parser.parse_args())


if __name__ == "__main__":
    main()
