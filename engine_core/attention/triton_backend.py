"""Attention through our Triton kernels (engine_core/attention/triton_kernels.py): the CUDA path.

KV stores, decodes and the varlen prefill each take one launch per layer and read only the blocks a sequence
uses, so the fixed full-width block tables of CUDA graphs cost nothing: this backend is graphable. On CPU it runs
only in tests, through the Triton interpreter (TRITON_INTERPRET=1 set before triton is first imported).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core.attention.metadata import AttentionMetadata


@dataclass
class _Args:
    """The step's int32 kernel arrays, built on the first layer's use (a no-op copy for what already is int32)."""

    decode_tables: torch.Tensor | None
    decode_lens: torch.Tensor | None
    cu_seqlens_q: torch.Tensor | None
    context_lens: torch.Tensor | None
    prefill_tables: torch.Tensor | None


def _build_args(meta: AttentionMetadata) -> _Args:
    tables, lens = meta.decode_block_tables, meta.decode_seq_lens
    i32 = torch.int32
    decode = (tables.to(i32), lens.to(i32)) if tables is not None and lens is not None else (None, None)
    if not meta.prefills:
        return _Args(*decode, None, None, None)
    return _Args(*decode, meta.query_start_loc(i32), meta.context_lens(i32), meta.prefill_block_tables(i32))


class TritonBackend:
    name = "triton"
    graphable = True  # cost independent of the block-table width
    index_dtype = torch.int32  # the model runner builds decode tables and lengths in int32 already

    def __init__(self) -> None:
        from engine_core.attention import triton_kernels  # imports triton: only when this backend is chosen

        self.kernels = triton_kernels

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:  # fmt: skip
        """q: [T, Hq, D], k/v: [T, Hk, D]: stores k/v at meta.slot_mapping, then attends. Returns [T, Hq, D]."""
        kernels = self.kernels
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        args = meta.cached("triton", _build_args)
        n = meta.num_decodes
        if n == q.shape[0] and not meta.prefills:  # decode-only (every CUDA graph step): no extra copy
            return kernels.paged_decode(q, k_cache, v_cache, args.decode_tables, args.decode_lens, scale, window=window)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if n:
            kernels.paged_decode(q[:n], k_cache, v_cache, args.decode_tables, args.decode_lens, scale, out=out[:n],
                                 window=window)  # fmt: skip
        first, end = meta.prefill_rows
        if meta.prefills:
            kernels.paged_prefill(q[first:end], k_cache, v_cache, args.cu_seqlens_q, args.context_lens,
                                  args.prefill_tables, scale, out[first:end], window)  # fmt: skip
        out[end:].zero_()  # padding rows, as on the other backends
        return out
