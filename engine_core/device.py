"""Where and how the engine computes: the device, the dtype, the step budget, the CPU process's threads and heap, and
the padded row counts of a step."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import torch

from common.model_errors import ConfigError
from engine_core.cpu_kernels import cpu_kernels
from engine_core.kernel_build import cpu_flags


def padded_size(num_tokens: int, min_rows: int = 8) -> int:
    """A step's token count rounded up, so that few distinct matmul shapes occur: oneDNN builds a kernel per
    shape (about 1 ms per linear the first time), and with continuous batching the count changes every step.
    Below 8, a power of two no smaller than min_rows (see prepare_linears): a single stream's decode reads the
    weights for one or two rows, not eight. min_rows 1 means our CPU matmul kernels, which build nothing per
    shape and cost the same per row at any count: no padding (it would only add rows, up to 63 of a prefill)."""
    if min_rows == 1:
        return num_tokens
    if 0 < num_tokens < 8:
        return max(min_rows, 1 << (num_tokens - 1).bit_length())
    multiple = 8 if num_tokens <= 256 else 64
    return -(-num_tokens // multiple) * multiple


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def step_token_budget(configured: int | None, device: torch.device) -> int:
    """--max-num-batched-tokens, or vLLM's server default: 8192 on a GPU of 70 GiB or more other than an A100 (fewer,
    larger prefill steps; vLLM measured an A100 slower with them), 2048 elsewhere."""
    if configured is not None:
        return configured
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        if props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower():
            return 8192
    return 2048


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls at least as fast as fp32's: AVX512-BF16 or AMX, or our bf16 linears for AVX2 + FMA
    (csrc/linear_avx2.c), which beat torch's fp32 matmul there in prefill and decode alike, at half the bytes."""
    flags = cpu_flags()
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        return True
    kernels = cpu_kernels()
    return kernels is not None and kernels.has_linear


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_fast_bf16() else torch.float32
    names = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "half": torch.float16}  # vLLM's --dtype names, its aliases included  # fmt: skip
    if name not in names:  # the command line's choices stop it there; this is for configs built in code (LLM)
        raise ConfigError(f"dtype {name!r} is not one of auto, {', '.join(names)}")
    return names[name]


def pick_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--kv-cache-dtype: auto keeps K/V in the model's dtype; fp8 (fp8_e4m3) in float8 e4m3 (saturated at +-448),
    half the bytes of bf16: twice the blocks in the same memory. fp8_e5m2 is not taken: with its 2 mantissa bits
    SmolLM2's greedy answers drifted well beyond what a change of bf16 kernel moves them (README, Models). CPU and a
    bf16 model only, for now."""
    if name == "auto":
        return dtype
    if name not in ("fp8", "fp8_e4m3"):  # the command line's choices stop it there; this is for configs built in code
        raise ConfigError(f"kv_cache_dtype {name!r} is not one of auto, fp8, fp8_e4m3")
    if device.type != "cpu" or dtype != torch.bfloat16:
        raise ConfigError(f"--kv-cache-dtype {name} runs on CPU with a bfloat16 model only (this one: {device.type}, "
                          f"{str(dtype).removeprefix('torch.')})")  # fmt: skip
    return torch.float8_e4m3fn


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library, for the heap's settings (mallopt here, malloc_trim in engine_core/huge_pages.py); None where
    none is found."""
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def tune_cpu_process(num_threads: int | None) -> None:
    # One thread per core we may run on; more would fight the socket threads for the same cores.
    torch.set_num_threads(num_threads or len(os.sched_getaffinity(0)))
    # Keep freed step-sized temporaries in the heap. By default glibc hands blocks above its mmap threshold back
    # to the kernel, and every step page-faults them in again: a 2048-token prefill took 1.1 s instead of 0.8 s.
    c = libc()
    if c is not None and hasattr(c, "mallopt"):  # glibc
        m_trim_threshold, m_mmap_threshold = -1, -3
        c.mallopt(m_mmap_threshold, 32 * 2**20)  # glibc's largest allowed value
        c.mallopt(m_trim_threshold, 2**30)
