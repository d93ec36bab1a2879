"""Compiles our Triton kernels for a CUDA architecture on a machine without a GPU, as the launchers would launch
them, and prints one JSON line per launch with the registers and spill stack that ptxas reports.

python -m tests.triton_compile_probe 90     (run without TRITON_INTERPRET: the interpreter cannot compile)

The launchers in engine_core/attention/triton_kernels.py run on `meta` tensors (shapes, strides and dtypes, no
data); each kernel they launch is replaced by a recorder that binds the arguments with Triton's own JIT binder
(the same specialisation: constexprs, 16-byte divisibility) and compiles for the target with the ptxas that ships
in the triton wheel. The interpreter tests check what the kernels compute; this checks that they compile for a
real GPU and keep their tiles in registers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from engine_core.attention import triton_kernels as tk
from engine_core.models import moe_triton

# (q heads, KV heads, head dim) of the models bench/make_random_model.py writes: SmolLM2-135M, a 1B and a 7B Llama;
# and the tests' tiny models (heads of 8 or 16: below tl.dot's smallest K unless padded).
SHAPES = {"smollm2-135m": (9, 3, 64), "llama-1b": (32, 8, 64), "llama-7b": (32, 32, 128), "tiny": (4, 2, 8)}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KERNELS = ("_store_kv_kernel", "_decode_kernel", "_reduce_kernel", "_prefill_kernel")
# (hidden, expert intermediate, experts, top k) of Qwen3-30B-A3B and of the tests' tiny mixtures of experts
MOE_SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "tiny": (48, 40, 6, 2)}
MOE_LAUNCHES = 4  # gate/up and down, each with the smallest and the largest block of rows
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, spill stack bytes) of a compiled kernel, as cuobjdump reads them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
    match = re.search(r"REG:(\d+).*?STACK:(\d+)", out)
    assert match is not None, out
    return int(match.group(1)), int(match.group(2))


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` compiles instead of launching."""

    def __init__(self, fn, target: GPUTarget, label: str) -> None:
        self.fn, self.target, self.label = fn, target, label
        self.backend = make_backend(target)

    def __getitem__(self, grid):
        def launch(*args, **kwargs) -> None:
            fn, backend = self.fn, self.backend
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            bound, specialization, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
            record = {"kernel": fn.__name__, "case": self.label,
                      "constexprs": {k: v for k, v in kwargs.items() if not k.startswith("num_")}}  # fmt: skip
            try:
                src = ASTSource(fn, signature, constexprs, attrs)
                compiled = triton.compile(src, target=self.target, options=options.__dict__)
                record["registers"], record["spill_bytes"] = resource_usage(compiled.asm["cubin"])
            except Exception as exc:  # reported, not raised: the test lists every failure at once
                record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            print(json.dumps(record), flush=True)

        return launch


def launch_all(arch: int) -> None:
    target = GPUTarget("cuda", arch, 32)
    meta = torch.device("meta")
    originals = {name: getattr(tk, name) for name in KERNELS}
    for shape, (q_heads, kv_heads, head_dim) in SHAPES.items():
        for dtype_name, dtype in DTYPES.items():
            for name, fn in originals.items():
                setattr(tk, name, Recorder(fn, target, f"{shape} {dtype_name}"))
            cache = torch.empty(64, 16, kv_heads, head_dim, dtype=dtype, device=meta)
            tokens, width = 8, 512
            q = torch.empty(tokens, q_heads, head_dim, dtype=dtype, device=meta)
            k = torch.empty(tokens, kv_heads, head_dim, dtype=dtype, device=meta)
            lens = torch.empty(tokens, dtype=torch.int32, device=meta)
            tables = torch.empty(tokens, width, dtype=torch.int32, device=meta)
            tk.store_kv(k, k, cache, cache, torch.empty(tokens, dtype=torch.long, device=meta))
            tk.paged_decode(q, cache, cache, tables, lens, 0.125, num_splits=1)
            tk.paged_decode(q, cache, cache, tables, lens, 0.125, num_splits=8)  # and the reduce kernel
            tk.paged_prefill(q, cache, cache, lens[:3], lens[:2], tables[:2], 0.125, torch.empty_like(q))
    for name, fn in originals.items():
        setattr(tk, name, fn)
    grouped = moe_triton._grouped_matmul_kernel
    for shape, (hidden, inter, experts, top_k) in MOE_SHAPES.items():
        for dtype_name, dtype in DTYPES.items():
            moe_triton._grouped_matmul_kernel = Recorder(grouped, target, f"{shape} {dtype_name}")
            x = torch.empty(64, hidden, dtype=dtype, device=meta)
            w13 = torch.empty(experts, 2 * inter, hidden, dtype=dtype, device=meta)
            w2 = torch.empty(experts, hidden, inter, dtype=dtype, device=meta)
            for block_m in (16, 64):
                slots = 64 * top_k
                capacity = -(-(slots + experts * (block_m - 1)) // block_m) * block_m
                blocks = moe_triton.Blocks(torch.empty(capacity, dtype=torch.long, device=meta),
                                           torch.empty(capacity // block_m, dtype=torch.long, device=meta), slots,
                                           block_m)  # fmt: skip
                act = moe_triton.grouped_matmul(x, w13, blocks, top_k, a_by_token=True)[:, :inter]
                moe_triton.grouped_matmul(act, w2, blocks, top_k, a_by_token=False)
    moe_triton._grouped_matmul_kernel = grouped


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "the interpreter cannot compile: unset TRITON_INTERPRET"
    launch_all(int(sys.argv[1]))
