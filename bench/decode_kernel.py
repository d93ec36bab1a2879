"""Decode attention alone: the compiled CPU kernel (csrc/decode_bf16.c with AVX512-BF16, csrc/decode_avx2.c with
AVX2, through CpuKernels.paged_decode) over 30 layers of SmolLM2's heads (9 query / 3 KV heads of 64, bf16, blocks
of 16), for batches shaped like the engine's:

- distinct sequences (an ordinary decode step);
- consecutive rows of one sequence, each one key longer than the last: the outputs a recompute replays after a
  preemption or a restart, and a request's draft rows under speculative decoding.

Prints the fastest and the median of --repeats passes per shape. To compare two checkouts, run it from outside both,
in turn (python -m puts the working directory first on the path):
cd /tmp && PYTHONPATH=<checkout> python -m bench.decode_kernel [--repeats 15] [--result-json F]
With --kv-cache-dtype fp8, each shape is also timed over fp8 (e4m3) caches holding the same values, the two in turn.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from engine_core.attention.torch_backend import to_fp8
from engine_core.cpu_kernels import cpu_kernels

LAYERS, BLOCK, Q_HEADS, KV_HEADS, HEAD_DIM = 30, 16, 9, 3, 64

# name -> (lens of the rows, whether the rows are one sequence's)
SHAPES: dict[str, tuple[list[int], bool]] = {
    "recompute 1536 rows, 513..2048 keys": (list(range(513, 2049)), True),
    "recompute 256 rows, 257..512 keys": (list(range(257, 513)), True),
    "drafts 5 rows, 4092..4096 keys": (list(range(4092, 4097)), True),
    "drafts 5 rows, 396..400 keys": (list(range(396, 401)), True),
    "batch 16 x 448 keys": ([448] * 16, False),
    "batch 64 x 192 keys": ([192] * 64, False),
    "batch 64 x 512 keys": ([512] * 64, False),
    "one row, 4096 keys": ([4096], False),
    "one row, 256 keys": ([256], False),  # a lone stream's step: shorter than a part of SPLIT_KEYS
    "one row, 500 keys": ([500], False),
}


def time_shape(lens: list[int], one_sequence: bool, repeats: int, fp8: bool = False) -> dict[str, list[float]]:
    kernels = cpu_kernels()
    assert kernels is not None, "needs the compiled CPU kernels (a C compiler)"
    width = -(-max(lens) // BLOCK)
    blocks = width if one_sequence else width * len(lens)
    order = torch.randperm(blocks)
    tables = order.view(1, width).expand(len(lens), width).contiguous() if one_sequence else order.view(-1, width)
    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = {"bf16": [(torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16))
                       for _ in range(LAYERS)]}  # fmt: skip
    if fp8:  # the same values (rounded to e4m3) in both
        caches["fp8"] = [(to_fp8(k), to_fp8(v)) for k, v in caches["bf16"]]
        caches["bf16"] = [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in caches["fp8"]]
    q = torch.randn(len(lens), Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(repeats):
        for name, layers in caches.items():
            start = time.perf_counter()
            for k_cache, v_cache in layers:
                kernels.paged_decode(q, k_cache, v_cache, tables, seq_lens, HEAD_DIM**-0.5)
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--result-json")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {}
    for name, (lens, one_sequence) in SHAPES.items():
        for cache, times in time_shape(lens, one_sequence, args.repeats, args.kv_cache_dtype == "fp8").items():
            key = name if cache == "bf16" else f"{name}, {cache} cache"
            results[key] = {"min_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3}
            print(f"{key}: {results[key]['min_ms']:.2f} ms fastest, {results[key]['median_ms']:.2f} median", flush=True)
    if args.result_json:
        machine = {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
        settings = {"layers": LAYERS, "block_size": BLOCK, "heads": [Q_HEADS, KV_HEADS, HEAD_DIM], "dtype": "bfloat16",
                    "kv_cache_dtype": args.kv_cache_dtype}  # fmt: skip
        with open(args.result_json, "w") as f:
            json.dump({"machine": machine, "settings": settings, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
