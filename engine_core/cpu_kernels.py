"""The CPU decode-attention kernel (csrc/paged_decode.c): compiled once per machine with the system C
compiler, loaded with ctypes. Absent (None) when there is no compiler; attention then uses torch."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("roseinfer.kernels")
SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
_FUNCS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def _build() -> ctypes.CDLL | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None or os.environ.get("ROSEINFER_NO_KERNELS"):
        return None
    # -march=native: the binary is keyed by the CPU's flags, so a different machine compiles its own.
    key = hashlib.sha256(SOURCE.read_bytes() + _cpu_flags().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("ROSEINFER_CACHE_DIR", Path.home() / ".cache" / "roseinfer")) / "kernels"
    lib = cache / f"paged_decode-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        cmd = [cc, "-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-lm", "-o", tmp]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            os.replace(tmp, lib)  # atomic: concurrent builders never load a half-written file
        except (subprocess.SubprocessError, OSError) as exc:
            log.warning("CPU attention kernel not built (%s); using the torch path", exc)
            Path(tmp).unlink(missing_ok=True)
            return None
    return ctypes.CDLL(str(lib))


class DecodeKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        limits = [ctypes.c_int() for _ in range(3)]
        lib.paged_decode_limits(*map(ctypes.byref, limits))
        self.max_group, self.max_dim, self.max_block = (x.value for x in limits)
        for name in _FUNCS.values():
            getattr(lib, name).argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float]

    def supports(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        return (
            q.device.type == "cpu"
            and q.dtype in _FUNCS
            and k_cache.dtype == q.dtype
            and q.shape[1] // num_kv_heads <= self.max_group
            and head_dim <= self.max_dim
            and block_size <= self.max_block
        )

    def __call__(self, q, k_cache, v_cache, block_tables, seq_lens, scale: float) -> torch.Tensor:
        """q: [S, Hq, D] (one token per sequence); caches [blocks, block_size, Hk, D]; int64 tables/lens."""
        q = q.contiguous()
        out = torch.empty_like(q)
        num_seqs, num_q_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        getattr(self.lib, _FUNCS[q.dtype])(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
            out.data_ptr(), num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1], scale,
        )  # fmt: skip
        return out


_kernel: DecodeKernel | None | bool = False  # False: not tried yet


def decode_kernel() -> DecodeKernel | None:
    global _kernel
    if _kernel is False:
        lib = _build()
        _kernel = DecodeKernel(lib) if lib is not None else None
    return _kernel  # type: ignore[return-value]
