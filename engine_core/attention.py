"""Paged attention: per-step metadata, KV writes into cache slots, and attention over block tables.

The flat batch of a step holds the single-token decodes first, then the prefill chunks. Decodes are
attended in one batched call over their gathered blocks; prefill chunks (few per step) one by one.
The torch path runs on CPU and CUDA; on CPU, compiled kernels take the decodes, and all prefill chunks of a
step in one call, reading K/V from the blocks, when they could be built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine_core.cpu_kernels import cpu_kernels


@dataclass
class PrefillChunk:
    start: int  # first token of this chunk in the flat batch
    num_tokens: int  # query length
    context_len: int  # tokens in the cache after this chunk (cached prefix + chunk)
    block_ids: torch.Tensor  # the blocks covering context_len tokens
    mask: torch.Tensor | None = None  # torch path: [q, context] bool; None = plain causal over the chunk alone


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every token in the flat batch
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks]
    decode_seq_lens: torch.Tensor | None = None  # [D] context length including the new token
    prefills: list[PrefillChunk] = field(default_factory=list)
    block_size: int = 16
    _decode_mask: torch.Tensor | None = None
    _prefill_kernel_args: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def decode_mask(self) -> torch.Tensor:
        """[D, 1, 1, max_blocks * block_size] bool, key within context; built once, for the torch path."""
        if self._decode_mask is None:
            assert self.decode_block_tables is not None and self.decode_seq_lens is not None
            max_len = self.decode_block_tables.shape[1] * self.block_size
            key_pos = torch.arange(max_len, device=self.decode_seq_lens.device)
            self._decode_mask = (key_pos[None, :] < self.decode_seq_lens[:, None]).view(self.num_decodes, 1, 1, -1)
        return self._decode_mask

    @staticmethod
    def build(
        slot_mapping: torch.Tensor,
        decode_block_tables: torch.Tensor | None,
        decode_seq_lens: torch.Tensor | None,
        prefills: list[PrefillChunk],
        block_size: int,
    ) -> AttentionMetadata:
        """Every layer reuses it; what only one attention path needs is built on that path's first use."""
        num_decodes = 0 if decode_block_tables is None else decode_block_tables.shape[0]
        return AttentionMetadata(slot_mapping, num_decodes, decode_block_tables, decode_seq_lens, prefills, block_size)

    @property
    def prefill_kernel_args(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For the CPU prefill kernel, built once per step: [C, 3] (first row, rows, context) and block tables."""
        if self._prefill_kernel_args is None:
            chunks = torch.tensor([[c.start, c.num_tokens, c.context_len] for c in self.prefills])
            tables = torch.nn.utils.rnn.pad_sequence([c.block_ids for c in self.prefills], batch_first=True)
            self._prefill_kernel_args = chunks, tables
        return self._prefill_kernel_args

    def prefill_mask(self, chunk: PrefillChunk) -> torch.Tensor | None:
        """Torch path: None when the chunk is the whole context (plain causal), else [q, context] bool, built
        once per step."""
        if chunk.mask is None and chunk.context_len != chunk.num_tokens:  # a cached prefix or earlier chunks
            q_pos = torch.arange(chunk.num_tokens, device=self.slot_mapping.device) + (
                chunk.context_len - chunk.num_tokens
            )
            k_pos = torch.arange(chunk.context_len, device=self.slot_mapping.device)
            chunk.mask = k_pos[None, :] <= q_pos[:, None]
        return chunk.mask


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """k_cache: [num_blocks, block_size, kv_heads, head_dim]; k: [T, kv_heads, head_dim]."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hk, D] (this step's, already written to the cache). Returns [T, Hq, D].
    Tokens after the decodes and prefill chunks are padding: attended by nobody, their output is zero."""
    n = meta.num_decodes
    if n == q.shape[0] and not meta.prefills:  # the common decode-only step: no extra copy
        return _decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)  # rows of padding tokens stay zero
    if n:
        out[:n] = _decode_attention(q[:n], k_cache, v_cache, meta, scale)
    if not meta.prefills:
        return out
    kernels = cpu_kernels() if q.device.type == "cpu" else None
    if kernels is not None and kernels.supports_prefill(q, k_cache):
        kernels.paged_prefill(q, k_cache, v_cache, *meta.prefill_kernel_args, out, scale)
        return out
    for chunk in meta.prefills:
        s, e = chunk.start, chunk.start + chunk.num_tokens
        mask = meta.prefill_mask(chunk)
        if mask is None:
            out[s:e] = _attend(q[s:e], k[s:e], v[s:e], None, scale, causal=True)
        else:
            ck = k_cache[chunk.block_ids].flatten(0, 1)[: chunk.context_len]
            cv = v_cache[chunk.block_ids].flatten(0, 1)[: chunk.context_len]
            out[s:e] = _attend(q[s:e], ck, cv, mask, scale, causal=False)
    return out


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    assert meta.decode_block_tables is not None
    kernels = cpu_kernels() if q.device.type == "cpu" else None
    if kernels is not None and kernels.supports_decode(q, k_cache):
        return kernels.paged_decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale)
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    # [D, blocks, block_size, Hk, hd] -> [D, Hk, L, hd]
    keys = k_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
    values = v_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
    # Grouped-query attention without expanding K/V: the query heads of one KV head act as its rows.
    group_q = q.view(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(group_q, keys, values, attn_mask=meta.decode_mask, scale=scale)
    return out.reshape(num_seqs, num_q_heads, head_dim)


def _attend(q, k, v, mask, scale: float, causal: bool) -> torch.Tensor:
    """One sequence: q [Tq, Hq, D], k/v [Tk, Hk, D]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:  # expanded by hand: SDPA's enable_gqa falls back to its slow math path on CPU
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    # 4-D inputs: with 3-D ones SDPA takes its slow math path on CPU instead of the flash kernel.
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return out[0].transpose(0, 1)
