"""The compiled CPU decode kernel against the torch reference path, on ragged paged batches."""

from __future__ import annotations

import pytest
import torch

from engine_core import attention
from engine_core.attention import AttentionMetadata
from engine_core.cpu_kernels import cpu_kernels


# head_dim 24 takes the portable path; multiples of 16 the vector path where the CPU has AVX-512.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 16), (6, 2, 24)])
def test_kernel_matches_torch_path(monkeypatch, dtype, tol, q_heads, kv_heads, head_dim) -> None:
    assert cpu_kernels() is not None, "the C compiler is part of the supported setup; the kernel must build"
    torch.manual_seed(0)
    num_blocks, block_size, seqs = 64, 16, 7
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    lens = torch.tensor([1, 5, 16, 17, 40, 63, 100])
    tables = torch.randperm(num_blocks)[: seqs * 7].view(seqs, 7)
    q = torch.randn(seqs, q_heads, head_dim, dtype=dtype)
    meta = AttentionMetadata.build(torch.zeros(seqs, dtype=torch.long), tables, lens, [], block_size)
    fast = attention.paged_attention(q, q[:, :kv_heads], q[:, :kv_heads], k_cache, v_cache, meta, 0.3)
    monkeypatch.setattr(attention, "cpu_kernels", lambda: None)
    reference = attention.paged_attention(q, q[:, :kv_heads], q[:, :kv_heads], k_cache, v_cache, meta, 0.3)
    assert torch.allclose(fast.float(), reference.float(), atol=tol, rtol=tol)
    # A sequence of length 1 attends only to its first key: the output is exactly that value row.
    first = v_cache[tables[0, 0], 0].float().repeat_interleave(q_heads // kv_heads, dim=0)
    assert torch.allclose(fast[0].float(), first, atol=tol)
