"""Attention through our compiled C kernels (engine_core/cpu_kernels.py): the production CPU path.

Decodes in one kernel call, all prefill chunks of a step in another, both reading K/V straight from the blocks.
Whether the kernels handle the model's shapes is decided once, by select_backend; a model whose prefill shapes the
prefill kernel does not take (or a build without it) attends its prefill chunks through the torch reference.
The kernels expect what our models pass: q rows may be strided, heads and head_dim contiguous within a row.
Both take a sliding window.
"""

from __future__ import annotations

import torch

from engine_core.attention.metadata import AttentionMetadata
from engine_core.attention.torch_backend import TorchBackend
from engine_core.cpu_kernels import CpuKernels


class CpuKernelBackend(TorchBackend):
    name = "cpu"

    def __init__(self, kernels: CpuKernels, kernel_prefill: bool) -> None:
        self.kernels = kernels
        self.kernel_prefill = kernel_prefill

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int | None = None) -> torch.Tensor:  # fmt: skip
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        return self.kernels.paged_decode(q, k_cache, v_cache, tables, lens, scale, window)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                window: int | None = None) -> None:  # fmt: skip
        if not self.kernel_prefill:
            super().prefill(q, k, v, k_cache, v_cache, meta, scale, out, window)
            return
        chunks, tables = meta.cached("cpu_prefill", _prefill_args)
        self.kernels.paged_prefill(q, k_cache, v_cache, chunks, tables, out, scale, window)


def _prefill_args(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [C, 3] (first row, rows, context after the chunk) and the chunks' block tables [C, W]."""
    chunks = torch.tensor([[c.start, c.num_tokens, c.context_len] for c in meta.prefills])
    return chunks, meta.prefill_block_tables(torch.long)
