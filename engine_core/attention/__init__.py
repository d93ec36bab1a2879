"""Paged attention: per-step metadata (metadata.py) and the backends that store K/V into the paged cache and
attend over it: torch_backend.py (reference, any device), cpu_backend.py (our C kernels), triton_backend.py
(CUDA, kernels in triton_kernels.py). selection.py picks one at engine start; the model runner binds it to every
attention layer beside its k_cache/v_cache, and the layers call `attn_backend.forward(...)`."""

from engine_core.attention.cpu_backend import CpuKernelBackend
from engine_core.attention.metadata import AttentionMetadata, PrefillChunk
from engine_core.attention.selection import CHOICES, AttentionBackend, select_backend
from engine_core.attention.torch_backend import TorchBackend, write_kv

__all__ = [
    "CHOICES",
    "AttentionBackend",
    "AttentionMetadata",
    "CpuKernelBackend",
    "PrefillChunk",
    "TorchBackend",
    "select_backend",
    "write_kv",
]
