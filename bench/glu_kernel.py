"""A gated MLP's first half on CPU, the two ways the engine can run it: the gate_up linear then act_and_mul (two
kernel calls, the [rows, 2 x intermediate] product written to memory and read back), and csrc/glu_amx.c's one call
(CpuKernels.linear_glu, AMX only). Shapes: SmolLM2-135M's MLP (576 -> 2 x 1536) at 2048 and 64 rows, a 1B Llama's
(2048 -> 2 x 8192) at 2048 rows; random bf16 weights. Prints the fastest of --repeats calls each way, the two ways
in turn, twice.

python -m bench.glu_kernel [--repeats 30] [--result-json F]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from engine_core.cpu_kernels import cpu_kernels
from engine_core.device import tune_cpu_process
from engine_core.linear_packing import pack_bf16

SHAPES = [(2048, 576, 1536), (64, 576, 1536), (2048, 2048, 8192)]  # rows, hidden, intermediate


def fastest(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--result-json")
    args = parser.parse_args()
    tune_cpu_process(None)
    kernels = cpu_kernels()
    assert kernels is not None and kernels.has_amx_linear, "needs the compiled kernels on an AMX CPU"
    torch.manual_seed(0)
    results = []
    for rows, hidden, half in SHAPES:
        weight = torch.randn(2 * half, hidden, dtype=torch.bfloat16) * 0.2
        x, packed = torch.randn(rows, hidden, dtype=torch.bfloat16), pack_bf16(weight, kernels.panel_cols)
        def two_calls(x=x, p=packed, h=half):
            return kernels.act_and_mul(kernels.linear(x, p, None, 2 * h), "silu")

        def fused(x=x, p=packed, h=half):
            return kernels.linear_glu(x, p, None, h, "silu")

        calls = {"two_calls_ms": two_calls, "fused_ms": fused}
        repeats = max(3, args.repeats * 1536 * 576 // (half * hidden))
        ms: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(2):
            for name, call in calls.items():
                ms[name].append(fastest(call, repeats))
        results.append({"rows": rows, "hidden": hidden, "intermediate": half, **ms})
        print(f"{rows} x {hidden} -> 2 x {half}: two calls {' / '.join(f'{t:.3f}' for t in ms['two_calls_ms'])} ms, "
              f"fused {' / '.join(f'{t:.3f}' for t in ms['fused_ms'])} ms", flush=True)  # fmt: skip
    if args.result_json:
        machine = {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
        with open(args.result_json, "w") as f:
            json.dump({"machine": machine, "repeats": args.repeats, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
