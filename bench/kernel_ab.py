"""Two builds of our linear kernel in one process, in turn: this checkout's csrc/ and another checkout's (a worktree
of an earlier commit), each compiled as engine_core/kernel_build.py compiles it, each called straight through
ctypes on the same packed weights (bench.linear_kernel's SmolLM2 layers and LM head, packed by this checkout), the
order turned round every pass. Separate processes on these shared cores drifted by 10-15% from one run to the next;
passes interleaved in one process see the same machine. Where the other build packs a format differently, its
results are wrong but its work is the same: only the time is compared.

python -m bench.kernel_ab --other /tmp/before [--quantization grid | int8 | int4] [--rows 1,8,16] [--passes 40]
    [--result-json F]
python -m bench.kernel_ab --other-march x86-64-v3 ...: this checkout against itself built for another target (the
    AVX2 kernels, on an AVX-512 CPU).
ROSEINFER_AMX=0 compares the AVX-512 tiles (csrc/linear.c) instead of the AMX ones.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from bench.linear_kernel import HIDDEN, LAYER_SHAPES, LAYERS, VOCAB, pack
from engine_core.cpu_kernels import LINEAR_ARGS, cpu_kernels
from engine_core.huge_pages import move_packed_weights
from engine_core.kernel_build import build_library
from engine_core.linear_packing import weight_format


def load(library: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library))
    lib.linear.argtypes = LINEAR_ARGS
    return lib


def other_library(checkout: str) -> Path:
    """The other checkout's kernels, built by its own kernel_build (its sources, its flags)."""
    spec = importlib.util.spec_from_file_location("other_kernel_build", Path(checkout) / "engine_core/kernel_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_library("cc")


def on_huge_pages(packed: list[torch.Tensor]) -> list[torch.Tensor]:
    """The packed weights moved onto 2 MiB pages by the engine's own move (engine_core/huge_pages.py), which takes
    them from modules: on 4 KiB pages the TLB misses added about 10 us to every call of these sizes."""
    holders = nn.ModuleList(nn.Module() for _ in packed)
    for holder, p in zip(holders, packed, strict=True):
        holder.packed_weight = p
    move_packed_weights(holders)
    return [holder.packed_weight for holder in holders]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    other = parser.add_mutually_exclusive_group(required=True)
    other.add_argument("--other", help="another checkout (e.g. a git worktree)")
    other.add_argument("--other-march", help="this checkout compiled for another -march (x86-64-v3: AVX2)")
    parser.add_argument("--quantization", choices=["int8", "int4", "grid"])
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--passes", type=int, default=40)
    parser.add_argument("--result-json")
    args = parser.parse_args()
    kernels = cpu_kernels()
    assert kernels is not None and kernels.has_linear, "needs our compiled linear kernel"
    other_lib = other_library(args.other) if args.other else build_library("cc", args.other_march)
    libs = {"this": load(build_library("cc")), "other": load(other_lib)}
    torch.manual_seed(0)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) / k**0.5 for _ in range(LAYERS) for n, k in LAYER_SHAPES]
    packed = on_huge_pages([pack(kernels, w, args.quantization) for w in weights])
    layers = [(p, *w.shape) for p, w in zip(packed, weights, strict=True)]
    head = (pack(kernels, torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16), args.quantization), VOCAB, HIDDEN)
    results = {}
    for rows in map(int, args.rows.split(",")):
        x = {k: torch.randn(rows, k).bfloat16() for k in {k for _, _, k in layers}}
        out = {n: torch.empty(rows, n, dtype=torch.bfloat16) for n in {n for _, n, _ in [*layers, head]}}
        calls = {part: [(x[k].data_ptr(), k, rows, p.data_ptr(), weight_format(p), None, out[n].data_ptr(), n, n, k)
                        for p, n, k in linears]
                 for part, linears in (("layers", layers), ("head", [head]))}  # fmt: skip
        times: dict[tuple[str, str], list[float]] = {(b, part): [] for b in libs for part in calls}
        for i in range(args.passes + 2):  # the first two build the thread pools and fault the pages in
            for build in (libs if i % 2 else reversed(libs)):
                for part, part_calls in calls.items():
                    start = time.perf_counter()
                    for call in part_calls:
                        libs[build].linear(*call)
                    if i >= 2:
                        times[(build, part)].append(time.perf_counter() - start)
        for part in calls:
            this, other = (statistics.median(times[(b, part)]) * 1e3 for b in libs)
            results[f"{rows} rows {part}"] = {"this_median_ms": this, "other_median_ms": other,
                                              "this_over_other": this / other}  # fmt: skip
            print(f"{rows:5d} rows {part:>6}: this {this:7.2f} ms, other {other:7.2f} ms (median of {args.passes}), "
                  f"this / other {this / other:.3f}")  # fmt: skip
    if args.result_json:
        machine = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                   "ROSEINFER_AMX": os.environ.get("ROSEINFER_AMX", "1")}  # fmt: skip
        with open(args.result_json, "w") as f:
            json.dump({"other": args.other or f"-march={args.other_march}", "quantization": args.quantization,
                       "machine": machine, "results": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
