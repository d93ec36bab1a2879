"""The AttentionBackend protocol, and the choice of one backend for the engine's lifetime.

Chosen once at start for the device, dtype and the model's attention shapes (heads of this tensor-parallel rank):
CUDA -> Triton; CPU -> the C kernels when they built and take these shapes, else torch. `choice` (the
--attention-backend flag, or ROSEINFER_ATTENTION_BACKEND when the flag is auto) forces one, for tests and
comparisons; a forced backend that cannot run here is an error rather than a silent fallback.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

import torch

from common.model_errors import ConfigError
from engine_core.attention.cpu_backend import CpuKernelBackend
from engine_core.attention.metadata import AttentionMetadata
from engine_core.attention.torch_backend import TorchBackend
from engine_core.cpu_kernels import cpu_kernels

log = logging.getLogger("roseinfer.attention")
CHOICES = ("auto", "torch", "cpu", "triton")
ENV = "ROSEINFER_ATTENTION_BACKEND"


class AttentionBackend(Protocol):
    name: str
    graphable: bool  # decode steps may replay from CUDA graphs with the fixed full-width block tables
    index_dtype: torch.dtype  # dtype of the decode block tables and lengths it wants

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:  # fmt: skip
        """Stores k/v [T, Hk, D] into the caches at meta.slot_mapping, then attends: q [T, Hq, D] -> [T, Hq, D].
        With a window, each query sees only its last `window` keys (itself included)."""
        ...


def select_backend(choice: str, device: torch.device, dtype: torch.dtype, num_q_heads: int, num_kv_heads: int,
                   head_dim: int, block_size: int, kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """kv_dtype: the KV cache's (the model's dtype unless --kv-cache-dtype says otherwise)."""
    if choice == "auto":
        choice = os.environ.get(ENV, "auto")
    if choice not in CHOICES:
        raise ConfigError(f"attention backend {choice!r}: expected one of {', '.join(CHOICES)}")
    backend: AttentionBackend
    if choice == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("the Triton attention backend runs on CPU only in Triton's interpreter (TRITON_INTERPRET=1)")
    if choice == "triton" and kv_dtype not in (None, dtype):
        raise ConfigError(f"the Triton attention backend keeps K/V in the model's dtype, not {kv_dtype}")
    if choice == "triton" or (choice == "auto" and device.type == "cuda"):
        backend = _triton(forced=choice == "triton")
    elif choice == "cpu" or (choice == "auto" and device.type == "cpu"):
        backend = _cpu(device, dtype, num_q_heads, num_kv_heads, head_dim, block_size, kv_dtype or dtype,
                       forced=choice == "cpu")  # fmt: skip
    else:
        backend = TorchBackend()
    detail = f" (kernel prefill: {backend.kernel_prefill})" if isinstance(backend, CpuKernelBackend) else ""
    log.info("attention backend: %s%s", backend.name, detail)
    return backend


def _triton(forced: bool) -> AttentionBackend:
    from engine_core.attention.triton_backend import TritonBackend

    try:
        return TritonBackend()
    except ImportError as exc:  # no triton, or no kernels in this build
        if forced:
            raise
        log.warning("Triton attention unavailable (%s); using the torch backend", exc)
        return TorchBackend()


def _cpu(device: torch.device, dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
         block_size: int, kv_dtype: torch.dtype, forced: bool) -> AttentionBackend:  # fmt: skip
    kernels = cpu_kernels() if device.type == "cpu" else None
    # Tensors of the model's shapes (a qkv-like row layout) to ask the kernels' limits about.
    q = torch.empty(1, num_q_heads, head_dim, dtype=dtype)
    k_cache = torch.empty(1, block_size, num_kv_heads, head_dim, dtype=kv_dtype)
    if kernels is not None and kernels.supports_decode(q, k_cache):
        widened = k_cache.to(dtype)  # what prefill reads of an fp8 cache (CpuKernelBackend.prefill)
        return CpuKernelBackend(kernels, kernel_prefill=kernels.supports_prefill(q, widened))
    why = "not built" if kernels is None else f"no support for {dtype}, {num_q_heads}/{num_kv_heads} x {head_dim}"
    why += f", a {kv_dtype} KV cache" if kv_dtype != dtype else ""
    if forced:
        raise ConfigError(f"the CPU attention kernels cannot run this model on {device}: {why}")
    log.info("CPU attention kernels unusable (%s); using the torch backend", why)
    return TorchBackend()
