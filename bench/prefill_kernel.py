"""Prefill attention alone: the compiled CPU kernel (csrc/attend_bf16.c for bf16 with AVX512-BF16, else
csrc/attend_avx2.c with AVX2 + FMA, through CpuKernels.paged_prefill) over one layer of SmolLM2's heads (9 query /
3 KV heads of 64, blocks of 16), for chunks shaped like the engine's prefill steps:

- W's step: 16 prompts of 128 tokens;
- one 512-token prompt;
- the first and the last 2048-token chunk of an 8192-token prompt (the last one attends to 6144 cached keys).

Prints the fastest and the median of --repeats calls per shape, per layer, and the fastest as GFLOP/s (2 x 2 x
head_dim multiply-adds per query head, query row and key it may see). To compare two checkouts, run it from outside
both, in turn (python -m puts the working directory first on the path):
cd /tmp && PYTHONPATH=<checkout> python -m bench.prefill_kernel [--repeats 5] [--dtype float32] [--result-json F]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from engine_core.cpu_kernels import cpu_kernels

BLOCK, Q_HEADS, KV_HEADS, HEAD_DIM = 16, 9, 3, 64

# name -> chunks of (query rows, context length after the chunk)
SHAPES: dict[str, list[tuple[int, int]]] = {
    "16 prompts x 128 tokens": [(128, 128)] * 16,
    "one 512-token prompt": [(512, 512)],
    "2048 rows, keys 0..2048": [(2048, 2048)],
    "2048 rows, keys 0..8192": [(2048, 8192)],
}


def visible_keys(chunks: list[tuple[int, int]]) -> int:
    """Query row x key pairs the causal mask lets through."""
    return sum(rows * (context - rows) + rows * (rows + 1) // 2 for rows, context in chunks)


def time_shape(chunks: list[tuple[int, int]], dtype: torch.dtype, repeats: int) -> list[float]:
    kernels = cpu_kernels()
    assert kernels is not None and kernels.has_prefill, "needs the compiled prefill kernel (AVX-512 or AVX2 + FMA)"
    widths = [-(-context // BLOCK) for _, context in chunks]
    order = torch.randperm(sum(widths))
    tables = torch.zeros(len(chunks), max(widths), dtype=torch.int64)
    used = 0
    for c, width in enumerate(widths):
        tables[c, :width] = order[used : used + width]
        used += width
    spec, row = [], 0
    for rows, context in chunks:
        spec.append([row, rows, context])
        row += rows
    chunk_spec = torch.tensor(spec, dtype=torch.int64)
    shape = (used, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    # q is a strided view into a qkv projection, as in the model
    qkv = torch.randn(row, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype)
    q = qkv[:, : Q_HEADS * HEAD_DIM].view(-1, Q_HEADS, HEAD_DIM)
    assert kernels.supports_prefill(q, k_cache)
    out = torch.empty(row, Q_HEADS, HEAD_DIM, dtype=dtype)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        kernels.paged_prefill(q, k_cache, v_cache, chunk_spec, tables, out, HEAD_DIM**-0.5)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--result-json")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    results = {}
    for name, chunks in SHAPES.items():
        times = time_shape(chunks, dtype, args.repeats)
        flops = 4 * HEAD_DIM * Q_HEADS * visible_keys(chunks)
        results[name] = {"min_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3,
                         "gflops": flops / min(times) / 1e9}  # fmt: skip
        r = results[name]
        print(f"{name}: {r['min_ms']:.2f} ms fastest, {r['median_ms']:.2f} median, {r['gflops']:.0f} GFLOP/s",
              flush=True)  # fmt: skip
    if args.result_json:
        machine = {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
        settings = {"block_size": BLOCK, "heads": [Q_HEADS, KV_HEADS, HEAD_DIM], "dtype": args.dtype}
        with open(args.result_json, "w") as f:
            json.dump({"machine": machine, "settings": settings, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
