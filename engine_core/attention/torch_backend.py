"""The reference attention backend in plain torch: any device, any dtype, any shape.

Decodes are attended in one batched call over their gathered blocks (its cost grows with the block-table width,
so CUDA graphs, whose tables have the fixed full width, are not used with it); prefill chunks (few per step) one by
one, a chunk without cached context straight from its own k/v. A sliding window (a layer's `window`: each query
sees its last `window` keys, itself included, as transformers' sliding_attention layers) is one more mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_core.attention.metadata import AttentionMetadata, PrefillChunk

MAX_DECODE_GATHER_BYTES = 256 * 2**20  # K and V gathered by one slice of decode rows
FP8_MAX = 448.0  # the largest float8 e4m3: K/V beyond it are stored as it


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x as an fp8 KV cache (--kv-cache-dtype fp8) holds it: float8 e4m3, saturated, NaN as 0 (as csrc/kv_fp8.c
    writes: with no NaN in the cache, the AVX2 kernel widens without checking for one)."""
    return x.clamp(-FP8_MAX, FP8_MAX).nan_to_num(0.0).to(torch.float8_e4m3fn)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """k_cache: [num_blocks, block_size, kv_heads, head_dim]; k: [T, kv_heads, head_dim]."""
    for cache, new in ((k_cache, k), (v_cache, v)):
        if cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no float8 kernel on CPU: copied as bytes
            cache, new = cache.view(torch.uint8), to_fp8(new).view(torch.uint8)
        cache.view(-1, *new.shape[1:]).index_copy_(0, slots, new)


class TorchBackend:
    name = "torch"
    graphable = False  # the decode gather reads the whole table width: graphs were 2x slower than eager on H100
    index_dtype = torch.long  # dtype of the block tables and lengths the model runner builds

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:  # fmt: skip
        """q: [T, Hq, D], k/v: [T, Hk, D]: stores k/v at meta.slot_mapping, then attends. Returns [T, Hq, D]."""
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        n = meta.num_decodes
        if n == q.shape[0] and not meta.prefills:  # the common decode-only step: no extra copy
            return self.decode(q, k_cache, v_cache, meta, scale, window)
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)  # rows of padding tokens stay zero
        if n:
            out[:n] = self.decode(q[:n], k_cache, v_cache, meta, scale, window)
        if meta.prefills:
            self.prefill(q, k, v, k_cache, v_cache, meta, scale, out, window)
        return out

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int | None = None) -> torch.Tensor:  # fmt: skip
        tables = meta.decode_block_tables
        assert tables is not None
        mask = meta.cached(f"torch_decode_mask_{window}", lambda m: _decode_mask(m, window))
        # Each row gathers its table's whole width of K and V: a step of many rows (a request's recomputed outputs,
        # up to the token budget) over long contexts would gather gigabytes at once, so rows go a slice at a time.
        per_row = 2 * tables.shape[1] * k_cache[0].numel() * k_cache.element_size()
        rows = max(1, MAX_DECODE_GATHER_BYTES // per_row)
        if q.shape[0] <= rows:
            return _decode_rows(q, k_cache, v_cache, tables, mask, scale)
        return torch.cat([_decode_rows(q[s : s + rows], k_cache, v_cache, tables[s : s + rows], mask[s : s + rows],
                                       scale) for s in range(0, q.shape[0], rows)])  # fmt: skip

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                window: int | None = None) -> None:  # fmt: skip
        """Writes the rows of every prefill chunk into out."""
        masks = meta.cached(f"torch_prefill_masks_{window}",
                            lambda m: [_prefill_mask(c, window, m.slot_mapping.device) for c in m.prefills])
        for chunk, mask in zip(meta.prefills, masks, strict=True):
            s, e = chunk.start, chunk.start + chunk.num_tokens
            if mask is None:
                out[s:e] = _attend(q[s:e], k[s:e], v[s:e], None, scale, causal=True)
            else:
                ck = k_cache[chunk.block_ids].flatten(0, 1)[: chunk.context_len].to(q.dtype)  # an fp8 cache widened,
                cv = v_cache[chunk.block_ids].flatten(0, 1)[: chunk.context_len].to(q.dtype)
                if k_cache.dtype != q.dtype:  # the chunk's own rows its fresh K/V, as CpuKernelBackend reads them
                    ck[-chunk.num_tokens :], cv[-chunk.num_tokens :] = k[s:e], v[s:e]
                out[s:e] = _attend(q[s:e], ck, cv, mask, scale, causal=False)


def _decode_rows(q, k_cache, v_cache, tables: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    # [D, blocks, block_size, Hk, hd] -> [D, Hk, L, hd]
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2).to(q.dtype)  # an fp8 cache widened
    values = v_cache[tables].flatten(1, 2).transpose(1, 2).to(q.dtype)
    # Grouped-query attention without expanding K/V: the query heads of one KV head act as its rows.
    group_q = q.view(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(group_q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_q_heads, head_dim)


def _decode_mask(meta: AttentionMetadata, window: int | None) -> torch.Tensor:
    """[D, 1, 1, W * block_size] bool, key within context (and within the window's last keys). A padding row
    (length 0) sees its first key instead of nothing: a row with no key at all would come out NaN; its output is
    dropped anyway."""
    assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
    max_len = meta.decode_block_tables.shape[1] * meta.block_size
    key_pos = torch.arange(max_len, device=meta.decode_seq_lens.device)
    lens = meta.decode_seq_lens.clamp(min=1)[:, None]
    mask = key_pos[None, :] < lens
    if window is not None:
        mask &= key_pos[None, :] >= lens - window
    return mask.view(meta.num_decodes, 1, 1, -1)


def _prefill_mask(chunk: PrefillChunk, window: int | None, device: torch.device) -> torch.Tensor | None:
    """None when plain causal attention over the chunk alone is exact (no cached context, no window reached), else
    [q, context] bool."""
    windowed = window is not None and chunk.context_len > window
    if chunk.context_len == chunk.num_tokens and not windowed:
        return None
    q_pos = torch.arange(chunk.num_tokens, device=device) + (chunk.context_len - chunk.num_tokens)
    k_pos = torch.arange(chunk.context_len, device=device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if windowed:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def _attend(q, k, v, mask, scale: float, causal: bool) -> torch.Tensor:
    """One sequence: q [Tq, Hq, D], k/v [Tk, Hk, D]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:  # expanded by hand: SDPA's enable_gqa falls back to its slow math path on CPU
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    # 4-D inputs: with 3-D ones SDPA takes its slow math path on CPU instead of the flash kernel.
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return out[0].transpose(0, 1)
