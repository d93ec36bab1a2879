"""The compiled CPU attention kernels (CpuKernelBackend) against the torch reference backend, on ragged paged
batches."""

from __future__ import annotations

import pytest
import torch

from engine_core.attention import AttentionMetadata, CpuKernelBackend, PrefillChunk, TorchBackend
from engine_core.cpu_kernels import cpu_kernels
from tests.cpu_features import needs_prefill_kernel


# head_dim 12 takes the portable path; multiples of 16 (AVX-512) or 8 (AVX2) the key-at-a-time vector path; bf16
# with multiples of 32 the 16-keys-at-a-time path where the CPU has AVX512-BF16 (csrc/decode_bf16.c), which block
# size 8 makes take partial slices, and 32 two slices per block; with AVX2, block sizes that are multiples of 8 the
# 8-keys-at-a-time path (csrc/decode_avx2.c), 4 the key-at-a-time one.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim",
                         [(9, 3, 64), (4, 4, 32), (8, 1, 16), (6, 2, 24), (6, 2, 128), (6, 2, 12)])  # fmt: skip
@pytest.mark.parametrize("block_size", [16, 8, 32, 4])
def test_kernel_matches_torch_path(dtype, tol, q_heads, kv_heads, head_dim, block_size) -> None:
    assert cpu_kernels() is not None, "the C compiler is part of the supported setup; the kernel must build"
    torch.manual_seed(0)
    num_blocks, seqs = 64 * 16 // block_size, 7
    # One block more than the tables use: the new k/v of every row go to its first slot, which nobody reads.
    k_cache = torch.randn(num_blocks + 1, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks + 1, block_size, kv_heads, head_dim, dtype=dtype)
    scratch = torch.full((seqs,), num_blocks * block_size)
    lens = torch.tensor([1, 5, 16, 17, 40, 63, 100])
    width = -(-100 // block_size)
    tables = torch.randperm(num_blocks)[: seqs * width].view(seqs, width)
    q = torch.randn(seqs, q_heads, head_dim, dtype=dtype)
    k, v = q[:, :kv_heads], q[:, :kv_heads]
    cpu, ref = CpuKernelBackend(cpu_kernels(), kernel_prefill=True), TorchBackend()

    def meta() -> AttentionMetadata:
        return AttentionMetadata.build(scratch, tables, lens, [], block_size)

    fast = cpu.forward(q, k, v, k_cache, v_cache, meta(), 0.3)
    reference = ref.forward(q, k, v, k_cache, v_cache, meta(), 0.3)
    assert torch.allclose(fast.float(), reference.float(), atol=tol, rtol=tol)
    # A sequence of length 1 attends only to its first key: the output is exactly that value row.
    first = v_cache[tables[0, 0], 0].float().repeat_interleave(q_heads // kv_heads, dim=0)
    assert torch.allclose(fast[0].float(), first, atol=tol)


# The tile kernels hold a tile's query rows in their lanes, 16 keys a softmax step: with AVX512-BF16, bf16 with
# head_dim % 32 == 0 takes 16 rows (csrc/attend_bf16.c; block size 32 makes it split blocks into slices, 8 leaves
# it to the next kernel); with AVX2 + FMA (AVX-512 CPUs included), what it leaves takes 8 (csrc/attend_avx2.c;
# blocks of 8 split those steps). Block size 4 is left to the key-at-a-time path everywhere.
@needs_prefill_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 16), (6, 2, 128)])
@pytest.mark.parametrize("block_size", [16, 32, 8, 4])
@pytest.mark.parametrize("window", [None, 7, 40])
def test_prefill_kernel_matches_torch_path(window, dtype, tol, q_heads, kv_heads, head_dim, block_size) -> None:
    """A mixed step: 3 decodes, then prefill chunks with no prefix, after a cached prefix, and a one-block
    chunk; q is a strided view into a qkv projection, as in the model. Padding rows must stay zero. With a sliding
    window (inside a block and a tile, across several) every row sees its last `window` keys."""
    torch.manual_seed(0)
    num_blocks = 80 * 16 // block_size
    # One block more than the tables use: the new k/v of every row go to its first slot, which nobody reads.
    k_cache = torch.randn(num_blocks + 1, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks + 1, block_size, kv_heads, head_dim, dtype=dtype)
    perm = torch.randperm(num_blocks)
    per_decode = -(-48 // block_size)
    decode_tables = perm[: 3 * per_decode].view(3, per_decode)
    decode_lens = torch.tensor([5, 33, 48])
    # (query rows, context after the chunk): the cache already holds every chunk's keys, as after write_kv.
    shapes = [(37, 37), (20, 70), (9, 16), (130, 130), (2, 3)]
    prefills, row, used = [], 3, 3 * per_decode
    for num_tokens, context in shapes:
        blocks = -(-context // block_size)
        prefills.append(PrefillChunk(row, num_tokens, context, perm[used : used + blocks]))
        row, used = row + num_tokens, used + blocks
    total = row + 5  # 5 padding rows
    qkv = torch.randn(total, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : q_heads * head_dim].view(total, q_heads, head_dim)
    # The kernel reads every key from the cache; the torch path reads a no-prefix chunk's own k/v, so they get
    # the cached values (the cache already holds them, as after write_kv).
    k_new = torch.zeros(total, kv_heads, head_dim, dtype=dtype)
    v_new = torch.zeros(total, kv_heads, head_dim, dtype=dtype)
    for chunk in prefills:
        s, e = chunk.start, chunk.start + chunk.num_tokens
        if chunk.context_len == chunk.num_tokens:
            k_new[s:e] = k_cache[chunk.block_ids].flatten(0, 1)[: chunk.num_tokens]
            v_new[s:e] = v_cache[chunk.block_ids].flatten(0, 1)[: chunk.num_tokens]

    def run(backend) -> torch.Tensor:
        meta = AttentionMetadata.build(torch.full((total,), num_blocks * block_size), decode_tables, decode_lens,
                                       [PrefillChunk(c.start, c.num_tokens, c.context_len, c.block_ids)
                                        for c in prefills], block_size)  # fmt: skip
        return backend.forward(q, k_new, v_new, k_cache, v_cache, meta, 0.2, window)

    kernels = cpu_kernels()
    assert kernels is not None and kernels.has_prefill and kernels.supports_prefill(q, k_cache)
    fast = run(CpuKernelBackend(kernels, kernel_prefill=True))
    reference = run(TorchBackend())
    assert torch.allclose(fast.float(), reference.float(), atol=tol, rtol=tol)
    assert not fast[row:].any()


@needs_prefill_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("window", [None, 21])
def test_prefill_rows_do_not_depend_on_their_chunk(window, dtype, block_size) -> None:
    """A prompt's last rows attended as one chunk after cached prefixes of 0 to 19 tokens (so tiles start at every
    offset) and beside other chunks: each row's output is bit for bit the same, as a prefix-cache hit needs; also
    where a sliding window starts each tile's walk over the keys further on."""
    torch.manual_seed(0)
    q_heads, kv_heads, head_dim, context = 9, 3, 64, 150
    blocks = -(-context // block_size)
    k_cache = torch.randn(2 * blocks + 1, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(2 * blocks + 1, block_size, kv_heads, head_dim, dtype=dtype)
    table = torch.randperm(2 * blocks)[:blocks]
    q = torch.randn(context, q_heads, head_dim, dtype=dtype) * 2
    kernels = cpu_kernels()
    assert kernels is not None and kernels.supports_prefill(q, k_cache)
    backend = CpuKernelBackend(kernels, kernel_prefill=True)
    outputs = []
    for cached in range(20):
        other = PrefillChunk(0, 13, 13, table[:1])  # another request's chunk first: the prompt's rows move
        chunk = PrefillChunk(13, context - cached, context, table)
        rows = torch.cat([q[:13], q[cached:]])
        meta = AttentionMetadata.build(torch.full((len(rows),), 2 * blocks * block_size), None, None, [other, chunk],
                                       block_size)  # fmt: skip
        outputs.append(backend.forward(rows, rows[:, :kv_heads], rows[:, :kv_heads], k_cache, v_cache, meta,
                                       0.125, window)[13:][19 - cached :])  # fmt: skip
    for cached, out in enumerate(outputs):
        assert torch.equal(out, outputs[0]), cached


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("head_dim", [64, 36])
@pytest.mark.parametrize("window", [None, 5, 100, 600])
def test_long_decodes_attended_in_parts_match_and_do_not_depend_on_the_batch(window, head_dim, block_size, dtype,
                                                                             tol) -> None:  # fmt: skip
    """Sequences longer than a part (512 keys) are attended in parts by any thread and combined, whichever kernel
    takes them (csrc/decode_bf16.c in bf16 with AVX512-BF16, csrc/decode_avx2.c with AVX2, and csrc/paged_decode.c
    elsewhere: float32 on AVX-512, any dtype without AVX2 or for a head_dim of 36, where only its portable path
    runs); parts have a fixed size, so each sequence's output is bit for bit the same alone as in a batch. With a
    sliding window (inside a block, across blocks, across parts) the parts start at the window's block and mask the
    keys before it."""
    torch.manual_seed(0)
    q_heads, kv_heads = 9, 3
    lens = torch.tensor([1500, 3, 600, 2049, 512, 513])
    width = -(-2049 // block_size)
    num_blocks = len(lens) * width
    k_cache = torch.randn(num_blocks + 1, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks + 1, block_size, kv_heads, head_dim, dtype=dtype)
    tables = torch.randperm(num_blocks).view(len(lens), width)
    q = torch.randn(len(lens), q_heads, head_dim, dtype=dtype) * 3  # peaked weights: parts' maxima differ
    cpu, ref = CpuKernelBackend(cpu_kernels(), kernel_prefill=True), TorchBackend()
    meta = AttentionMetadata.build(torch.full((len(lens),), num_blocks * block_size), tables, lens, [], block_size)
    batch = cpu.decode(q, k_cache, v_cache, meta, 0.125, window)
    reference = ref.decode(q, k_cache, v_cache, meta, 0.125, window)
    assert torch.allclose(batch.float(), reference.float(), atol=tol, rtol=tol)
    for s in range(len(lens)):
        alone = AttentionMetadata.build(meta.slot_mapping[s : s + 1], tables[s : s + 1], lens[s : s + 1], [],
                                        block_size)  # fmt: skip
        assert torch.equal(cpu.decode(q[s : s + 1], k_cache, v_cache, alone, 0.125, window), batch[s : s + 1]), s


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("window", [None, 100])
def test_rows_on_the_same_blocks_are_attended_together_and_each_as_alone(window, block_size) -> None:
    """Consecutive bf16 rows on the same blocks (a request's draft rows, or the outputs a recompute replays) share
    their key loads in csrc/decode_bf16.c; each row's output stays bit for bit what it is alone. The batch: one
    sequence's rows 400..699 (across the part boundary, ending in every position of a slice and a block; enough
    rows that up to 16 threads group them), 12 rows of a sequence that shares the first's first 600 keys (so
    the two group in the first part only), a row of another sequence, and a long one. With a sliding window, rows
    whose windows start in the same block group, each masking its own keys before its window."""
    torch.manual_seed(0)
    q_heads, kv_heads, head_dim = 9, 3, 64
    width = -(-1200 // block_size)
    num_blocks = 4 * width
    perm = torch.randperm(num_blocks)
    first, other, long = perm[:width], perm[width : 2 * width], perm[2 * width : 3 * width]
    sharing = torch.cat([first[: 600 // block_size], perm[3 * width : 3 * width + width - 600 // block_size]])
    rows = [(first, n) for n in range(400, 700)] + [(sharing, n) for n in range(700, 712)] + [(other, 77)]
    rows += [(long, 1200)]
    tables = torch.stack([table for table, _ in rows])
    lens = torch.tensor([n for _, n in rows])
    k_cache = torch.randn(num_blocks + 1, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    v_cache = torch.randn(num_blocks + 1, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    q = torch.randn(len(rows), q_heads, head_dim, dtype=torch.bfloat16) * 3
    cpu, ref = CpuKernelBackend(cpu_kernels(), kernel_prefill=True), TorchBackend()
    meta = AttentionMetadata.build(torch.full((len(rows),), num_blocks * block_size), tables, lens, [], block_size)
    batch = cpu.decode(q, k_cache, v_cache, meta, 0.125, window)
    reference = ref.decode(q, k_cache, v_cache, meta, 0.125, window)
    assert torch.allclose(batch.float(), reference.float(), atol=2e-2, rtol=2e-2)
    for s in range(len(rows)):
        alone = AttentionMetadata.build(meta.slot_mapping[s : s + 1], tables[s : s + 1], lens[s : s + 1], [],
                                        block_size)  # fmt: skip
        assert torch.equal(cpu.decode(q[s : s + 1], k_cache, v_cache, alone, 0.125, window), batch[s : s + 1]), s
