"""The linears alone: the compiled CPU kernel (with AVX512-BF16 csrc/linear.c, and csrc/linear_int4.c for int4;
with AVX2 csrc/linear_avx2.c, and csrc/linear_quant_avx2.c for int8 and int4; with --dtype float32
csrc/linear_f32.c, timed beside torch's fp32 matmul on the same weights; through CpuKernels.linear) over
SmolLM2-135M's 30 layers of linears (qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576) and its
LM head (576 -> 49152, only at decode's row counts: a prefill runs it on each prompt's last row), each layer its own
weights, so that they come from memory as in the engine. With --lora-rank R: a rank-R LoRA adapter's two products on
each of those linears instead (engine_core/lora.py).

Prints, per row count (1 and 8: decode latency; 64: W's full decode batch; 2048: a prefill step), the fastest and
the median of --repeats passes in ms, and the fastest as GFLOP/s. To compare two checkouts, run it from outside
both, in turn (python -m puts the working directory first on the path):
cd /tmp && PYTHONPATH=<checkout> python -m bench.linear_kernel [--repeats 5]
    [--quantization int8 | int4 | grid | --lora-rank 16 | --dtype float32] [--result-json F]
--quantization grid: the panels a bf16 model converted from a 4-bit GGUF reads at up to 16 rows
(engine_core/models/grid_weights.py): the layers int4 summed as bf16 (format 4), the head int8.
ROSEINFER_KERNEL_MARCH=x86-64-v3 times the AVX2 kernels on a CPU that also has AVX-512.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from engine_core.cpu_kernels import cpu_kernels
from engine_core.linear_packing import pack_bf16, pack_f32, pack_int4, pack_int4_as_bf16, pack_int8
from engine_core.models.grid_fit import quantize_int4, quantize_int8

LAYERS, HIDDEN, VOCAB = 30, 576, 49152
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out_features, in_features)
SHARDS = [3, 1, 2, 1]  # fused parts of each: a LoRA adapter's A stacks one rank per part, its B is block-diagonal
ROWS = [1, 8, 64, 2048]


def pack(kernels, weight: torch.Tensor, quantization: str | None) -> torch.Tensor:
    if weight.dtype == torch.float32:
        return pack_f32(weight, kernels.panel_cols)
    if quantization == "int8" or (quantization == "grid" and len(weight) == VOCAB):  # the grid's head: Q8_0's
        return pack_int8(*quantize_int8(weight), kernels.panel_cols)
    if quantization == "grid":
        return pack_int4_as_bf16(*quantize_int4(weight), kernels.panel_cols)
    if quantization == "int4":
        return pack_int4(*quantize_int4(weight), kernels.panel_cols)
    return pack_bf16(weight, kernels.panel_cols)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quantization", choices=["int8", "int4", "grid"])
    parser.add_argument("--lora-rank", type=int, help="time a LoRA adapter's products of this rank on every linear "
                        "(engine_core/lora.py: A, then B) instead of the base linears")  # fmt: skip
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--result-json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    kernels = cpu_kernels()
    assert kernels is not None and kernels.supports_linear(dtype, 2), "needs our compiled linear kernel for " + \
        args.dtype + " (AVX-512 or AVX2 + FMA)"  # fmt: skip
    torch.manual_seed(0)
    shapes = LAYER_SHAPES
    if args.lora_rank:  # A [parts x rank, in], then B [out, parts x rank]
        ranks = [parts * args.lora_rank for parts in SHARDS]
        shapes = [s for (n, k), r in zip(LAYER_SHAPES, ranks, strict=True) for s in ((r, k), (n, r))]
    # (weight, packed, out_features, in_features); the plain weight only where torch's matmul is timed beside ours
    plain = dtype == torch.float32
    weights = [torch.randn(n, k, dtype=dtype) / k**0.5 for _ in range(LAYERS) for n, k in shapes]
    layers = [(w if plain else None, pack(kernels, w, args.quantization), *w.shape) for w in weights]
    del weights
    head_weight = torch.randn(VOCAB, HIDDEN, dtype=dtype)
    head = (head_weight if plain else None, pack(kernels, head_weight, args.quantization), VOCAB, HIDDEN)
    paths = {"ours": lambda x, w, packed, n: kernels.linear(x, packed, None, n)}
    if plain:
        paths["torch"] = lambda x, w, packed, n: torch.nn.functional.linear(x, w)
    results = {}
    for rows in [1, 8, 16] if args.quantization == "grid" else ROWS:  # the grid is read up to 16 rows
        linears = layers + ([head] if rows <= 64 and not args.lora_rank else [])
        inputs = {k: torch.randn(rows, k, dtype=dtype) for k in {k for *_, k in linears}}
        flop = sum(2 * rows * n * k for *_, n, k in linears)
        head_note = " + LM head" if rows <= 64 and not args.lora_rank else ""
        for name, run in paths.items():
            times = []
            for _ in range(args.repeats + 1):  # the first pass builds the thread pools: not counted
                start = time.perf_counter()
                for w, packed, n, k in linears:
                    run(inputs[k], w, packed, n)
                times.append(time.perf_counter() - start)
            best, median = min(times[1:]), statistics.median(times[1:])
            results.setdefault(rows, {})[name] = {"best_ms": best * 1e3, "median_ms": median * 1e3,
                                                  "gflops": flop / best / 1e9}  # fmt: skip
            print(f"{rows:5d} rows{head_note:>10} {name:>5}: best {best * 1e3:8.2f} ms, median {median * 1e3:8.2f} "
                  f"ms, {flop / best / 1e9:6.1f} GFLOP/s")  # fmt: skip
    if args.result_json:
        machine = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                   "kernel_march": os.environ.get("ROSEINFER_KERNEL_MARCH", "native")}
        with open(args.result_json, "w") as f:
            json.dump({"dtype": args.dtype, "quantization": args.quantization, "lora_rank": args.lora_rank,
                       "machine": machine, "results": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
