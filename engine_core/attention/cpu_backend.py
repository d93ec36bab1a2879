"""Attention through our compiled C kernels (engine_core/cpu_kernels.py): the production CPU path.

Decodes in one kernel call, all prefill chunks of a step in another, both reading K/V straight from the blocks.
Whether the kernels handle the model's shapes is decided once, by select_backend; a model whose prefill shapes the
prefill kernel does not take (or a build without it) attends its prefill chunks through the torch reference.
The kernels expect what our models pass: q rows may be strided, heads and head_dim contiguous within a row.
Both take a sliding window. An fp8 KV cache (--kv-cache-dtype fp8) is read by the decode kernel itself; a step's
prefill chunks get their blocks widened to bf16 first, with their own rows' fresh K/V, as the torch reference reads
them.
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
        if k_cache.dtype != q.dtype:  # an fp8 cache: the chunks' blocks widened, their own rows the fresh K/V
            blocks, tables, rows = meta.cached("cpu_prefill_widened", _widened_args)
            first, end = meta.prefill_rows
            k_cache, v_cache = k_cache[blocks].to(q.dtype), v_cache[blocks].to(q.dtype)
            k_cache.view(-1, *k.shape[1:])[rows] = k[first:end]
            v_cache.view(-1, *v.shape[1:])[rows] = v[first:end]
        self.kernels.paged_prefill(q, k_cache, v_cache, chunks, tables, out, scale, window)


def _prefill_args(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [C, 3] (first row, rows, context after the chunk) and the chunks' block tables [C, W]."""
    chunks = torch.tensor([[c.start, c.num_tokens, c.context_len] for c in meta.prefills])
    return chunks, meta.prefill_block_tables(torch.long)


def _widened_args(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks the chunks read, one after the other (a block two chunks share, twice); the chunks' tables into
    that list [C, W]; and each prefill row's slot in it [R]."""
    blocks, tables, rows, offset = [], [], [], 0
    for c in meta.prefills:
        blocks.append(c.block_ids.long())
        tables.append(torch.arange(offset, offset + len(c.block_ids)))
        rows.append(offset * meta.block_size + torch.arange(c.context_len - c.num_tokens, c.context_len))
        offset += len(c.block_ids)
    return torch.cat(blocks), torch.nn.utils.rnn.pad_sequence(tables, batch_first=True), torch.cat(rows)
