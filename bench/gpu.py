"""GPU benchmark on one model directory (e.g. from bench/make_random_model.py), in one run:

- offline: N requests x input-len prompt x output-len tokens, all at once, on the engine's FIRST pass (as users run
  it: no warmup request; the engine's start, its memory profile and CUDA graphs, is not timed), then a second pass
  over fresh prompts;
- HF transformers `generate` on the same prompts at several static batch sizes: the best is the baseline;
- one stream alone: output tok/s and inter-token latency;
- the decode step at batch 64 and 256 (median over the steps where the whole batch decodes), beside its lower
  bound: max(bytes read / memory bandwidth, FLOPs / peak), where a step reads the weights once plus the KV cache
  of every context (mean context: input-len + output-len / 2).

python -m bench.gpu --model DIR [--num-prompts 256 --input-len 512 --output-len 256] [--hf-batch-sizes 32,64,128,256]
    [--decode-batches 64,256] [--mem-bandwidth 3.35e12] [--peak-flops 989e12] [--enforce-eager] [--result-json F]
A CPU smoke run: --device cpu --dtype float32 with a tiny workload.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
from pathlib import Path

from bench.make_random_model import tensor_shapes
from bench.offline import bench_hf, random_prompts, run_all_at_once
from common.config import EngineConfig
from frontend.offline.engine_link import EngineClient

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def environment(device: str) -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    if device != "cpu" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    else:
        env["gpu"] = None
        env["processor"] = platform.processor() or platform.machine()
    return env


def decode_bound(config: dict, batch: int, context: int, dtype_bytes: int, bandwidth: float, peak_flops: float) -> dict:
    """The decode step's floor for a Llama-shaped config: every weight read once (the embedding table only as the
    LM head; of a mixture of experts, the experts the batch is expected to choose), every context's K/V read once;
    2 FLOPs per weight a token uses (k of the experts) plus QK and PV over the context."""
    shapes = [(name, math.prod(s)) for name, s in tensor_shapes(config)
              if name != "model.embed_tokens.weight" or config.get("tie_word_embeddings")]  # fmt: skip
    experts = sum(n for name, n in shapes if ".mlp.experts." in name)
    dense = sum(n for _, n in shapes) - experts
    chosen = config.get("num_experts_per_tok", 1) / config.get("num_experts", 1)  # each token's share of the experts
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_per_token = 2 * layers * config["num_key_value_heads"] * head_dim * dtype_bytes
    read = (dense + experts * (1 - (1 - chosen) ** batch)) * dtype_bytes + batch * context * kv_per_token
    flops = batch * (2 * (dense + experts * chosen) + 4 * context * heads * head_dim * layers)
    t_bw, t_flops = read / bandwidth, flops / peak_flops
    return {"bytes_read": read, "flops": flops, "bandwidth_ms": t_bw * 1e3, "compute_ms": t_flops * 1e3,
            "bound_ms": max(t_bw, t_flops) * 1e3}  # fmt: skip


def run_engine_phases(args: argparse.Namespace) -> dict:
    batches = [int(b) for b in args.decode_batches.split(",") if b]
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                          max_num_seqs=max([args.num_prompts, *batches]),
                          max_model_len=args.input_len + args.output_len + 8,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enforce_eager=args.enforce_eager)  # fmt: skip
    seed = args.seed
    result: dict = {}
    with EngineClient(config) as engine:
        result["kv_cache_tokens"] = engine.ready.num_blocks * engine.ready.block_size  # as the memory profile sized it
        prompts = random_prompts(args.num_prompts, args.input_len, seed)
        result["first_pass"] = run_all_at_once(engine, prompts, args.output_len, "first-")
        again = random_prompts(args.num_prompts, args.input_len, seed + 1)  # fresh: no prefix cache hits
        result["second_pass"] = run_all_at_once(engine, again, args.output_len, "second-")
        result["single_stream"] = run_all_at_once(engine, random_prompts(1, args.input_len, seed + 2), args.output_len,
                                                  "single-")  # fmt: skip
        result["decode"] = {}
        for b in batches:
            run = run_all_at_once(engine, random_prompts(b, args.input_len, seed + 3 + b), args.output_len, f"b{b}-")
            result["decode"][b] = run
        stats = engine.call("stats").stats
        result["preemptions"] = stats.num_preempted if stats is not None else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--hf-batch-sizes", default="32,64,128,256", help="comma-separated; the best is the baseline")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: their decode steps against eager")
    parser.add_argument("--decode-batches", default="64,256")
    parser.add_argument("--mem-bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM: 3.35e12)")
    parser.add_argument("--peak-flops", type=float, default=989e12, help="FLOP/s (H100 SXM bf16 dense: 989e12)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()

    env = environment(args.device)
    print(f"device: {env.get('gpu') or env.get('processor')}, driver {env.get('driver')}, torch {env['torch']} "
          f"(CUDA {env['cuda']})")  # fmt: skip
    ours = run_engine_phases(args)
    hf_runs: list[dict] = []
    prompts = random_prompts(args.num_prompts, args.input_len, args.seed)
    for b in [] if args.skip_hf else [int(b) for b in args.hf_batch_sizes.split(",")]:
        try:
            hf_runs.append(bench_hf(prompts, args.output_len, args.dtype, b, args.model, args.device))
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one: record it and try the next size
            hf_runs.append({"batch_size": b, "error": str(exc).splitlines()[0][:200]})
    ok = [r for r in hf_runs if "output_tok_s" in r]
    best_hf = max(ok, key=lambda r: r["output_tok_s"]) if ok else None
    model_config = json.loads((Path(args.model) / "config.json").read_text())
    context = args.input_len + args.output_len // 2
    bounds = {b: decode_bound(model_config, int(b), context, DTYPE_BYTES[args.dtype], args.mem_bandwidth,
                              args.peak_flops) for b in ours["decode"]}  # fmt: skip
    result = {"workload": vars(args), "environment": env, "roseinfer": ours, "hf_generate": hf_runs,
              "ratio_first_pass_vs_best_hf": ours["first_pass"]["output_tok_s"] / best_hf["output_tok_s"]
              if best_hf else None, "decode_bounds": bounds}  # fmt: skip
    report(args, ours, hf_runs, best_hf, bounds)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2))


def report(args: argparse.Namespace, ours: dict, hf_runs: list[dict], best_hf: dict | None, bounds: dict) -> None:
    print(f"workload: {args.num_prompts} x {args.input_len} prompt x {args.output_len} output tokens, {args.dtype}, "
          f"model {args.model}")  # fmt: skip
    print(f"KV cache: {ours['kv_cache_tokens']} tokens; preemptions in the run: {ours['preemptions']}")
    for name in ("first_pass", "second_pass"):
        r = ours[name]
        print(f"roseinfer {name.replace('_', ' ')}: {r['output_tok_s']:9.1f} output tok/s ({r['seconds']:.1f} s)")
    for r in hf_runs:
        line = f"{r['output_tok_s']:9.1f} output tok/s ({r['seconds']:.1f} s)" if "output_tok_s" in r else r["error"]
        print(f"HF generate, batch {r['batch_size']:4d}: {line}")
    if best_hf:
        ratio = ours["first_pass"]["output_tok_s"] / best_hf["output_tok_s"]
        print(f"first pass / best HF (batch {best_hf['batch_size']}): {ratio:.2f}x")
    single = ours["single_stream"]
    print(f"single stream: {single['output_tok_s']:.1f} tok/s, inter-token {single['decode_step_ms_at_full_batch']:.2f}"
          " ms")  # fmt: skip
    for b, run in ours["decode"].items():
        bound = bounds[b]
        print(f"decode at batch {b}: step {run['decode_step_ms_at_full_batch']:.2f} ms (forward "
              f"{run['forward_ms_at_full_batch']:.2f} ms); bound {bound['bound_ms']:.2f} ms (memory "
              f"{bound['bandwidth_ms']:.2f} ms, compute {bound['compute_ms']:.2f} ms): "
              f"the step takes {run['decode_step_ms_at_full_batch'] / bound['bound_ms']:.1f}x the bound")  # fmt: skip


if __name__ == "__main__":
    main()
