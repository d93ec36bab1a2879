"""The Triton paged-attention kernels against a plain torch reference written here from first principles.

On CUDA they run natively (also in bf16); without CUDA they run in Triton's interpreter on CPU tensors. The
interpreter is chosen when @triton.jit decorates a function (triton 3.7 reads TRITON_INTERPRET then, for its own
library at its first import, which torch may trigger, and again at launch), so tests/conftest.py sets the flag for
the whole session before any test module is imported.
"""

from __future__ import annotations

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from engine_core.attention import triton_kernels as tk

ON_CUDA = torch.cuda.is_available()
# Without CUDA, tests/conftest.py has set TRITON_INTERPRET=1 for the session before anything imported triton.
assert ON_CUDA or isinstance(tk._decode_kernel, InterpretedFunction), "TRITON_INTERPRET=1 was set too late"

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
HEAD_DIM = 64


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
           window: int | None = None) -> torch.Tensor:  # fmt: skip
    """q [n, Hq, D] at positions q_pos [n] over keys 0..L-1 (k, v [L, Hk, D]): causal softmax attention, fp32;
    with a window, each query over its last `window` keys only."""
    if k.shape[0] == 0:
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    key_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    visible = (key_pos <= q_pos[:, None]) & (key_pos > q_pos[:, None] - (window or k.shape[0] + 1))
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.nan_to_num())  # NaN: keys no row sees (poisoned)


def gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` keys of a sequence: its blocks in table order, [length, Hk, D]."""
    block_size = cache.shape[1]
    return cache[table[: -(-length // block_size)].long()].flatten(0, 1)[:length]


def make_cache(lens: list[int], kv_heads: int, block_size: int, dtype: torch.dtype, extra: int = 4,
               head_dim: int = HEAD_DIM):  # fmt: skip
    """Caches and a block table [len(lens), W], W wider than any sequence needs. Blocks are shuffled; table
    entries past a sequence's blocks point at poison blocks full of NaN, and the slots past each sequence's
    last key hold NaN too: a kernel that reads anything beyond the context returns NaN."""
    needed = [-(-n // block_size) for n in lens]
    width = max(needed) + extra
    num_blocks = sum(needed) + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, device=DEVICE).to(dtype)
    v_cache = torch.randn(shape, device=DEVICE).to(dtype)
    poison = [num_blocks - 2, num_blocks - 1]
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    perm = torch.randperm(num_blocks - 2).tolist()
    table = torch.empty(len(lens), width, dtype=torch.int32)
    used = 0
    for i, (n, blocks) in enumerate(zip(lens, needed, strict=True)):
        table[i] = torch.tensor(perm[used : used + blocks] + [poison[j % 2] for j in range(width - blocks)])
        used += blocks
        if n % block_size:  # the tail of the last block is past the context
            k_cache[table[i, blocks - 1].item(), n % block_size :] = float("nan")
            v_cache[table[i, blocks - 1].item(), n % block_size :] = float("nan")
    return k_cache, v_cache, table.to(DEVICE)


def qkv_views(tokens: int, q_heads: int, kv_heads: int, dtype: torch.dtype, head_dim: int = HEAD_DIM):
    """q, k, v as strided views into one projection output, as the models produce them."""
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
    q_end, k_end = q_heads * head_dim, (q_heads + kv_heads) * head_dim
    return (qkv[:, :q_end].view(tokens, q_heads, head_dim), qkv[:, q_end:k_end].view(tokens, kv_heads, head_dim),
            qkv[:, k_end:].view(tokens, kv_heads, head_dim))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_slots(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    tokens, kv_heads, block_size = 9, 3, 16
    _, k, v = qkv_views(tokens, 9, kv_heads, dtype)
    k_cache = torch.zeros(6, block_size, kv_heads, HEAD_DIM, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(6 * block_size)[:tokens].to(DEVICE)
    slots[4] = -1  # a padding token: stored nowhere
    tk.store_kv(k, v, k_cache, v_cache, slots)
    keep = slots >= 0
    assert torch.equal(k_cache.view(-1, kv_heads, HEAD_DIM)[slots[keep]], k[keep])
    assert torch.equal(v_cache.view(-1, kv_heads, HEAD_DIM)[slots[keep]], v[keep])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == tokens - 1  # nothing else written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "q_heads,kv_heads,block_size,num_splits",
    [(9, 3, 16, None), (9, 3, 16, 3), (8, 2, 32, 4)],
)
def test_paged_decode_matches_reference(dtype, q_heads, kv_heads, block_size, num_splits) -> None:
    """Ragged lengths (1, a whole block, not block multiples, 0 for a CUDA-graph padding row) through a shuffled,
    over-wide table; forced split-K splits even these short contexts into several programs and reduces them."""
    torch.manual_seed(1)
    lens = [1, 17, 0, 16, 45, 130]
    k_cache, v_cache, table = make_cache(lens, kv_heads, block_size, dtype)
    q, _, _ = qkv_views(len(lens), q_heads, kv_heads, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = tk.paged_decode(q, k_cache, v_cache, table, seq_lens, 0.125, num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == dtype
    for b, n in enumerate(lens):
        k, v = gather(k_cache, table[b], n), gather(v_cache, table[b], n)
        expected = attend(q[b : b + 1], k, v, torch.tensor([n - 1], device=DEVICE), 0.125)[0]
        torch.testing.assert_close(out[b].float(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    assert not out[2].any()  # seq_len 0: zeros


def test_paged_decode_writes_into_out() -> None:
    torch.manual_seed(2)
    lens = [3, 33]
    k_cache, v_cache, table = make_cache(lens, 4, 16, torch.float32)
    q = torch.randn(2, 16, HEAD_DIM, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    assert tk.paged_decode(q, k_cache, v_cache, table, seq_lens, 0.1, out=out, num_splits=2) is out
    for b, n in enumerate(lens):
        k, v = gather(k_cache, table[b], n), gather(v_cache, table[b], n)
        expected = attend(q[b : b + 1], k, v, torch.tensor([n - 1], device=DEVICE), 0.1)[0]
        torch.testing.assert_close(out[b], expected, atol=2e-4, rtol=2e-4)


def test_split_heuristic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split-K only when (sequence, KV head) programs cannot fill the GPU, and never into tiny splits."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(tk, "_sm_count", lambda device: 132 if device.type == "cuda" else 1)
    assert tk.decode_num_splits(tk.PROGRAMS_PER_SM * 132 // 8, 8, 1 << 15, cuda) == 1  # the grid is full already
    assert tk.decode_num_splits(1, 8, 1 << 15, cuda) == tk.MAX_SPLITS  # one long sequence: split
    assert tk.decode_num_splits(16, 8, 1 << 15, cuda) == 8  # 128 programs x 8 >= 4 per SM
    assert tk.decode_num_splits(1, 8, 3 * tk.MIN_KEYS_PER_SPLIT, cuda) == 3  # capped by the widest context
    assert tk.decode_num_splits(1, 8, 256, cuda) == 1  # too few keys to split
    assert tk.decode_num_splits(1, 8, 1 << 15, torch.device("cpu")) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads,block_size,head_dim", [(9, 3, 16, 64), (8, 2, 32, 64), (4, 4, 16, 128)])
def test_paged_prefill_matches_reference(dtype, q_heads, kv_heads, block_size, head_dim) -> None:
    """Chunks in one call: a whole prompt over several query tiles, a chunk after a cached prefix, a
    one-token chunk, a short chunk after a long prefix. Rows outside the chunks are left alone. Heads of 128 take
    other tiles (_prefill_tiles), as fp32 does."""
    torch.manual_seed(3)
    shapes = [(70, 70), (20, 83), (1, 1), (5, 21)]  # (query rows, context after the chunk)
    k_cache, v_cache, table = make_cache([ctx for _, ctx in shapes], kv_heads, block_size, dtype, head_dim=head_dim)
    total = sum(n for n, _ in shapes) + 3  # 3 trailing rows belong to no chunk
    q, _, _ = qkv_views(total, q_heads, kv_heads, dtype, head_dim)
    cu = torch.tensor([0] + [sum(n for n, _ in shapes[: i + 1]) for i in range(len(shapes))], dtype=torch.int32)
    context = torch.tensor([ctx for _, ctx in shapes], dtype=torch.int32, device=DEVICE)
    out = torch.full((total, q_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    tk.paged_prefill(q, k_cache, v_cache, cu.to(DEVICE), context, table, 0.125, out)
    for c, (n, ctx) in enumerate(shapes):
        s, e = int(cu[c]), int(cu[c + 1])
        k, v = gather(k_cache, table[c], ctx), gather(v_cache, table[c], ctx)
        expected = attend(q[s:e], k, v, torch.arange(ctx - n, ctx, device=DEVICE), 0.125)
        torch.testing.assert_close(out[s:e].float(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    assert bool((out[int(cu[-1]) :] == 7.0).all())


def poison_before(cache: torch.Tensor, table: torch.Tensor, first: int) -> None:
    """NaN in a sequence's keys before `first`: a kernel that reads one returns NaN."""
    block_size = cache.shape[1]
    for pos in range(first):
        cache[int(table[pos // block_size]), pos % block_size] = float("nan")


@pytest.mark.parametrize("num_splits", [None, 3])
def test_paged_decode_attends_only_the_window(num_splits) -> None:
    """A sliding window: each sequence sees its last `window` keys, and never loads the ones before (NaN there)."""
    torch.manual_seed(4)
    lens, window = [1, 17, 0, 24, 45, 130], 24
    k_cache, v_cache, table = make_cache(lens, 2, 16, torch.float32)
    for b, n in enumerate(lens):
        poison_before(k_cache, table[b], n - window)
        poison_before(v_cache, table[b], n - window)
    q, _, _ = qkv_views(len(lens), 6, 2, torch.float32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = tk.paged_decode(q, k_cache, v_cache, table, seq_lens, 0.125, num_splits=num_splits, window=window)
    for b, n in enumerate(lens):
        k, v = gather(k_cache, table[b], n), gather(v_cache, table[b], n)
        expected = attend(q[b : b + 1], k, v, torch.tensor([n - 1], device=DEVICE), 0.125, window)[0]
        torch.testing.assert_close(out[b], expected, atol=2e-4, rtol=2e-4)


def test_paged_prefill_attends_only_the_window() -> None:
    """Chunks longer than the window, after a cached prefix longer than it, and shorter than it: each row sees its
    last `window` keys; keys before the first row's window are never loaded (NaN there)."""
    torch.manual_seed(5)
    shapes, window = [(70, 70), (20, 83), (1, 1), (5, 21), (3, 40)], 17
    k_cache, v_cache, table = make_cache([ctx for _, ctx in shapes], 2, 16, torch.float32)
    for c, (n, ctx) in enumerate(shapes):
        poison_before(k_cache, table[c], ctx - n - window + 1)
        poison_before(v_cache, table[c], ctx - n - window + 1)
    total = sum(n for n, _ in shapes)
    q, _, _ = qkv_views(total, 6, 2, torch.float32)
    cu = torch.tensor([0] + [sum(n for n, _ in shapes[: i + 1]) for i in range(len(shapes))], dtype=torch.int32)
    context = torch.tensor([ctx for _, ctx in shapes], dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    tk.paged_prefill(q, k_cache, v_cache, cu.to(DEVICE), context, table, 0.125, out, window)
    for c, (n, ctx) in enumerate(shapes):
        s, e = int(cu[c]), int(cu[c + 1])
        k, v = gather(k_cache, table[c], ctx), gather(v_cache, table[c], ctx)
        expected = attend(q[s:e], k, v, torch.arange(ctx - n, ctx, device=DEVICE), 0.125, window)
        torch.testing.assert_close(out[s:e], expected, atol=2e-4, rtol=2e-4)
