"""Triton kernels for paged attention on CUDA: KV writes into cache slots, decode and varlen prefill/extend.

Cache layout [num_blocks, block_size, Hk, D] (k_cache and v_cache with the same strides); every tensor has unit
stride along D. Keys are gathered per key through the block table, BLOCK_N keys (several cache blocks) per tile,
so a table may be wider than needed: entries past a sequence's length are never read. Launchers branch only on
shapes and never read device values, so decode can be captured in a CUDA graph. On CPU the kernels run only
in Triton's interpreter, for tests: TRITON_INTERPRET=1 must be set before triton is first imported in the process
(triton 3.7 reads it when decorating its own and these @jit functions, and again at launch): tests/conftest.py.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
DECODE_BLOCK_N = 64  # keys per decode tile (4 blocks of 16)
PREFILL_BLOCK_M = 64  # queries per prefill tile (16-bit heads of up to 64; others: _prefill_tiles)
PREFILL_BLOCK_N = 64  # keys per prefill tile
MAX_SPLITS = 32
PROGRAMS_PER_SM = 4  # decode is bandwidth-bound: a few small programs per SM keep enough loads in flight
MIN_KEYS_PER_SPLIT = 256  # at the widest context the table describes
NO_WINDOW = 2**30  # int32, past any context


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # a negative slot marks a padding token: nothing to store
        h = tl.arange(0, H_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < NUM_HEADS) & (d < HEAD_DIM)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
        k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
        tl.store(k_cache_ptr + dst, k, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, table_ptr, pos, valid, visible, kv_head, stride_cb, stride_cs,
                 stride_ch, scale_log2, d, d_mask, BLOCK_SIZE: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """One online-softmax step over the keys at positions `pos` (gathered through the block table): rows of q
    see the keys where `visible` [rows, keys] holds; keys where `valid` is false are not loaded."""
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    off = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet keeps zeros
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    v = tl.load(v_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit(do_not_specialize=["stride_bt", "window"])  # table widths vary by step: one compile at start serves all
def _decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
                   scale_log2, window, stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ob,
                   stride_oh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   PREC: tl.constexpr):  # fmt: skip
    """One program per (sequence, KV head, split): the GROUP query heads of the KV head are the rows of one dot,
    so each K/V tile is loaded once for all of them."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    first = tl.maximum(seq_len - window, 0)  # a sliding window's first key (a window past any length: 0)
    # Each split takes an even share of this sequence's keys, in whole tiles (so no block is read twice).
    per_split = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g
    row_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=row_mask, other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    table = table_ptr + seq * stride_bt
    for tile in range(start, end, BLOCK_N):
        pos = tile + n
        valid = pos < end
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, table, pos, valid, valid[None, :], kv_head,
                                     stride_cb, stride_cs, stride_ch, scale_log2, d, d < HEAD_DIM, BLOCK_SIZE,
                                     PREC)  # fmt: skip
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # seq_len 0: zeros
        out_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:  # partials [B, Hq, NUM_SPLITS], reduced by _reduce_kernel
        part = (seq * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=row_mask)
        tl.store(part_m_ptr + part, m_i, mask=g < GROUP)
        tl.store(part_l_ptr + part, l_i, mask=g < GROUP)


@triton.jit
def _reduce_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, stride_ob, stride_oh, HEAD_DIM: tl.constexpr,
                   D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    first = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < NUM_SPLITS
    m = tl.load(part_m_ptr + first + s, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + first + s, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits weigh 0
    denom = tl.sum(l_s * weight, 0)
    acc = tl.load(part_acc_ptr + (first + s)[:, None] * D_PAD + d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)  # seq_len 0: zeros
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=["num_chunks", "stride_bt", "window"])  # as _decode_kernel: compiled once, at start
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, ctx_ptr, table_ptr, scale_log2, window, num_chunks,
                    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """Program (tile, q head). Chunk c owns tile ids cu[c] // BLOCK_M + c onwards: enough for its
    cdiv(q_len, BLOCK_M) tiles, and the grid T // BLOCK_M + C covers every chunk without reading cu on the host."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    lo = 0  # binary search for the last chunk whose first tile id is <= pid
    hi = num_chunks
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(cu_ptr + mid) // BLOCK_M + mid <= pid:
            lo = mid
        else:
            hi = mid
    q_start = tl.load(cu_ptr + lo)
    q_len = tl.load(cu_ptr + lo + 1) - q_start
    # Within a chunk the last tiles (most keys) go first, so they do not set the tail of the launch.
    tile = tl.cdiv(q_len, BLOCK_M) - 1 - (pid - (q_start // BLOCK_M + lo))
    if tile >= 0:
        context = tl.load(ctx_ptr + lo)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, D_PAD)
        n = tl.arange(0, BLOCK_N)
        io_mask = (rows < q_len)[:, None] & (d < HEAD_DIM)[None, :]
        q_rows = (q_start + rows).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=io_mask, other=0.0)
        q_pos = context - q_len + rows  # causal: the chunk's queries are the last q_len positions
        kv_start = tl.maximum(context - q_len + tile * BLOCK_M - window + 1, 0)  # the tile's first row's window
        kv_end = tl.minimum(context, context - q_len + tile * BLOCK_M + BLOCK_M)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        table = table_ptr + lo.to(tl.int64) * stride_bt
        for key_start in range(kv_start, kv_end, BLOCK_N):
            pos = key_start + n
            valid = pos < kv_end
            visible = valid[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, table, pos, valid, visible, head // GROUP,
                                         stride_cb, stride_cs, stride_ch, scale_log2, d, d < HEAD_DIM, BLOCK_SIZE,
                                         PREC)  # fmt: skip
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def decode_num_splits(batch: int, kv_heads: int, max_keys: int, device: torch.device) -> int:
    """Split-K only when (sequence, KV head) programs cannot fill the GPU: aim at PROGRAMS_PER_SM per SM, at
    least MIN_KEYS_PER_SPLIT keys per split at the widest context the block table can describe. Shapes only."""
    programs, target = batch * kv_heads, PROGRAMS_PER_SM * _sm_count(device)
    if programs >= target:
        return 1
    wanted = triton.next_power_of_2(triton.cdiv(target, programs))
    return max(1, min(wanted, MAX_SPLITS, max_keys // MIN_KEYS_PER_SPLIT))


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(-1) == 1
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.shape[-2] % k_cache.shape[2] == 0


def _fp32(dtype: torch.dtype) -> bool:
    """fp32 caches take "ieee" dots (no TF32 rounding), which run on the FMA units with every product in registers."""
    return dtype == torch.float32


def _prefill_tiles(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int]:
    """(queries, keys, warps) per prefill program: tiles that compile without register spills for sm_80 and sm_90
    (tests/test_triton_compile.py; 64x64 over 4 or 8 warps spill for fp32's FMA dots and for 128-wide heads)."""
    if _fp32(dtype):
        return (32, 32, 8) if head_dim <= 64 else (32, 16, 8)
    return (PREFILL_BLOCK_M, PREFILL_BLOCK_N, 4) if head_dim <= 64 else (PREFILL_BLOCK_M, 32, 8)


def _d_pad(head_dim: int) -> int:
    """Head dims padded to a power of two of at least 16: tl.dot's smallest K on sm_80 and sm_90."""
    return max(16, triton.next_power_of_2(head_dim))


def _window(window: int | None) -> int:
    """A sliding window as the kernels take it: no window is one wider than any context."""
    return NO_WINDOW if window is None else window


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if _fp32(dtype) else "tf32"  # only fp32 operands read this


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:  # fmt: skip
    """k, v [T, Hk, D] (rows may be strided) into the caches at slot_mapping [T] (negative: skipped)."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(num_heads), D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )  # fmt: skip


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                 num_splits: int | None = None, window: int | None = None) -> torch.Tensor:  # fmt: skip
    """q [B, Hq, D] -> out [B, Hq, D]; sequence b attends to its seq_lens[b] keys (its last `window` of them)
    through block_tables[b]. num_splits overrides the split-K heuristic (decode_num_splits)."""
    _check_cache(q, k_cache, v_cache)
    batch, q_heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = decode_num_splits(batch, kv_heads, block_tables.shape[1] * block_size, q.device)
    group, d_pad = q_heads // kv_heads, _d_pad(head_dim)
    part_acc = part_m = part_l = out  # unused when there is one split
    if num_splits > 1:
        part_acc = torch.empty(batch, q_heads, num_splits, d_pad, dtype=torch.float32, device=q.device)
        part_m = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_m, part_l, scale * LOG2E, _window(window),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=num_splits,
        PREC=_precision(q.dtype), num_warps=8 if _fp32(q.dtype) else 4, num_stages=2,
    )  # fmt: skip
    if num_splits > 1:
        _reduce_kernel[(batch, q_heads)](
            part_acc, part_m, part_l, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim, D_PAD=d_pad,
            NUM_SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits), num_warps=4,
        )  # fmt: skip
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                  out: torch.Tensor, window: int | None = None) -> None:  # fmt: skip
    """Varlen causal attention of C chunks (rows cu_seqlens_q[c]:cu_seqlens_q[c+1] of q [T, Hq, D]) over their
    context_lens[c] cached keys; the chunk's queries are the last positions of that context, each seeing at most
    its last `window` keys. Writes out rows."""
    _check_cache(q, k_cache, v_cache)
    num_tokens, q_heads, head_dim = q.shape
    num_chunks = context_lens.shape[0]
    if num_tokens == 0 or num_chunks == 0:
        return
    block_m, block_n, warps = _prefill_tiles(q.dtype, head_dim)
    grid = (num_tokens // block_m + num_chunks, q_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, scale * LOG2E, _window(window),
        num_chunks,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), GROUP=q_heads // k_cache.shape[2], HEAD_DIM=head_dim,
        D_PAD=_d_pad(head_dim), BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        PREC=_precision(q.dtype), num_warps=warps, num_stages=2,
    )  # fmt: skip
