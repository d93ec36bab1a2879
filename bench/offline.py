"""Offline throughput: N requests x input-len random prompt tokens x output-len tokens, all at once,
roseinfer's engine core (direct ZMQ, no HTTP) next to transformers `generate` measured in the same run.

python -m bench.offline [--num-prompts 64 --input-len 128 --output-len 128] [--hf-batch-sizes 64,32] [--model DIR]
    [--quantization int8 | int4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

from common.config import EngineConfig
from common.messages import EngineOutputs, EngineRequest, SamplingParams
from frontend.offline.engine_link import EngineClient


def random_prompts(n: int, length: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The all-at-once workload shared by the offline and the overhead benchmarks."""
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)


def bench_roseinfer(prompts: list[list[int]], output_len: int, config: EngineConfig) -> dict:
    with EngineClient(config) as engine:
        engine.generate([EngineRequest("warmup", prompts[0][:16], SamplingParams(max_tokens=4))])
        return run_all_at_once(engine, prompts, output_len)


def run_all_at_once(engine: EngineClient, prompts: list[list[int]], output_len: int, tag: str = "") -> dict:
    """Sends every prompt at once to a started engine and waits for all; `tag` keeps request ids unique."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.send(EngineRequest(f"{tag}{i}", p, params))
    steps: list[EngineOutputs] = []
    done = generated = 0
    while done < len(prompts):
        msg = engine.next_outputs(timeout=600)
        steps.append(msg)
        generated += sum(len(o.new_token_ids) for o in msg.outputs)
        done += sum(o.finished for o in msg.outputs)
    elapsed = time.perf_counter() - start
    # Steady decode at full batch: steps where every request is running and each produced one token.
    full = [m for m in steps if m.stats and m.stats.num_running == len(prompts) and len(m.outputs) == len(prompts)]
    gaps = [b.timestamp - a.timestamp for a, b in zip(full, full[1:], strict=False)]
    forward = [m.stats.forward_time_s for m in full[1:]]  # type: ignore[union-attr]
    step_s = statistics.median(gaps) if gaps else float("nan")
    fwd_s = statistics.median(forward) if forward else float("nan")
    return {
        "output_tokens": generated,
        "seconds": elapsed,
        "output_tok_s": generated / elapsed,
        "decode_step_ms_at_full_batch": step_s * 1000,
        "forward_ms_at_full_batch": fwd_s * 1000,
        "share_outside_forward": 1 - fwd_s / step_s if gaps else float("nan"),
    }


def load_hf(model: str | None, dtype: str, device: str = "cpu"):  # transformers is imported only when called
    """transformers' model (the default one when None) in eval mode, torch on every CPU this process may use."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.model_source import resolve_model

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return AutoModelForCausalLM.from_pretrained(resolve_model(model).path, dtype=torch_dtype).eval().to(device)


def bench_hf(prompts: list[list[int]], output_len: int, dtype: str, batch_size: int, model: str | None = None,
             device: str = "cpu") -> dict:
    import torch

    hf = load_hf(model, dtype, device)
    generated = 0
    if device != "cpu":  # CUDA context, cuBLAS handles and kernels loaded outside the timing
        with torch.inference_mode():
            hf.generate(torch.tensor(prompts[:1], device=device), max_new_tokens=2, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i : i + batch_size], device=device)  # equal lengths: no padding needed
            out = hf.generate(batch, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                              pad_token_id=0)  # fmt: skip
            generated += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    if device != "cpu":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tok_s = generated / elapsed
    return {"batch_size": batch_size, "output_tokens": generated, "seconds": elapsed, "output_tok_s": tok_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--model", default=None, help="an HF directory or .gguf (default: the default model)")
    parser.add_argument("--hf-batch-sizes", default="64", help="comma-separated; the best is reported")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "int4"], help="ours only")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()

    prompts = random_prompts(args.num_prompts, args.input_len, args.seed)
    config = EngineConfig(model=args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_seqs=max(args.num_prompts, 1), quantization=args.quantization)  # fmt: skip
    ours = bench_roseinfer(prompts, args.output_len, config)
    hf_runs = [] if args.skip_hf else [
        bench_hf(prompts, args.output_len, args.dtype, int(b), args.model) for b in args.hf_batch_sizes.split(",")
    ]  # fmt: skip
    best_hf = max(hf_runs, key=lambda r: r["output_tok_s"]) if hf_runs else None
    result = {
        "workload": vars(args),
        "machine": {"cpus": len(os.sched_getaffinity(0)), "processor": platform.processor() or platform.machine(),
                    "kernel_march": os.environ.get("ROSEINFER_KERNEL_MARCH", "native")},
        "roseinfer": ours,
        "hf_generate": hf_runs,
        "ratio_vs_hf": ours["output_tok_s"] / best_hf["output_tok_s"] if best_hf else None,
    }
    print(f"workload: {args.num_prompts} requests x {args.input_len} prompt x {args.output_len} output tokens, "
          f"{args.dtype}, {result['machine']['cpus']} CPUs")  # fmt: skip
    print(f"roseinfer (ZMQ, no HTTP): {ours['output_tok_s']:8.1f} output tok/s  ({ours['seconds']:.1f} s)")
    print(f"  decode step at full batch: {ours['decode_step_ms_at_full_batch']:.1f} ms, forward "
          f"{ours['forward_ms_at_full_batch']:.1f} ms, outside the forward {ours['share_outside_forward']:.1%}")
    for r in hf_runs:
        print(f"HF generate, batch {r['batch_size']:3d}: {r['output_tok_s']:8.1f} output tok/s  ({r['seconds']:.1f} s)")
    if best_hf:
        print(f"ratio roseinfer / best HF: {result['ratio_vs_hf']:.2f}x")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
