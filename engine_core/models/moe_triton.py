"""A mixture of experts' layer on CUDA (engine_core/models/moe.py) in two Triton launches, with no host sync, so
decode steps replay from CUDA graphs.

The (token, choice) slots are grouped by expert into blocks of BLOCK_M rows, each block one expert's (its last
block padded with a sentinel slot): `align` computes that table with torch ops of fixed shapes. A grouped matmul
then computes, for each block, its rows times its expert's weight: the gate and up projections from the tokens'
hidden states, and after SiLU-and-multiply the down projection from the slots' own rows. Each output row is
written at its slot (token * top_k + choice), so a token's k outputs lie side by side for the weighted sum. An
expert's weights are read once per block of its rows, and blocks of experts nobody chose do no work.

Only launch shapes depend on the batch (the slots, BLOCK_M); nothing reads device values. On CPU the kernel runs
only in Triton's interpreter, for tests (see engine_core/attention/triton_kernels.py on TRITON_INTERPRET).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_slots"])
def _grouped_matmul_kernel(a_ptr, w_ptr, out_ptr, slot_ptr, block_expert_ptr, num_slots, n_len, k_len, stride_am,
                           stride_we, stride_wn, stride_om, TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PREC: tl.constexpr):  # fmt: skip
    """out[slot, n] = sum_k a[row, k] * w[expert, n, k] for the slots of block program_id(0); row = slot // TOP_K
    (the slot's token) with A_BY_TOKEN, else the slot itself."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:  # a block past the last expert's: nothing to do
        slots = tl.load(slot_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = slots < num_slots  # the sentinel pads an expert's last block
        if A_BY_TOKEN:
            rows = slots // TOP_K
        else:
            rows = slots
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < n_len
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_len, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < k_len
            a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :], mask=valid[:, None] & k_mask[None, :],
                        other=0.0)  # fmt: skip
            w = tl.load(w_ptr + expert * stride_we + n[None, :] * stride_wn + k[:, None],
                        mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # fmt: skip
            acc = tl.dot(a, w, acc, input_precision=PREC)
        tl.store(out_ptr + slots[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & n_mask[None, :])  # fmt: skip


@dataclass(frozen=True)
class Blocks:
    """The slots grouped by expert in blocks of `block_m`: slots [num_blocks * block_m] (the sentinel num_slots
    pads each expert's last block and the unused tail), and each block's expert [num_blocks] (-1: unused)."""

    slots: torch.Tensor
    experts: torch.Tensor
    num_slots: int
    block_m: int


def block_rows(num_slots: int, num_experts: int) -> int:
    """Rows per block: small where each expert gets a few tokens (decode), larger for prefill chunks. tl.dot
    takes no fewer than 16."""
    per_expert = num_slots / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def align(choices: torch.Tensor, num_experts: int, block_m: int) -> Blocks:
    """choices: each token's experts [T, k] -> Blocks, in torch ops whose shapes depend only on T, k, the number
    of experts and block_m (no device value is read on the host)."""
    flat = choices.flatten()
    num_slots = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount's length would need the max on the host
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)  # slot indices grouped by expert, each group in slot order
    grouped = flat[order]
    rank = torch.arange(num_slots, device=flat.device) - (counts.cumsum(0) - counts)[grouped]
    capacity = triton.cdiv(num_slots + num_experts * (block_m - 1), block_m) * block_m
    slots = torch.full((capacity,), num_slots, dtype=torch.int64, device=flat.device)
    slots[(ends - padded)[grouped] + rank] = order
    starts = torch.arange(0, capacity, block_m, device=flat.device)
    experts = torch.searchsorted(ends, starts, right=True)
    experts = torch.where(experts < num_experts, experts, -1)
    return Blocks(slots, experts, num_slots, block_m)


def grouped_matmul(a: torch.Tensor, w: torch.Tensor, blocks: Blocks, top_k: int, a_by_token: bool) -> torch.Tensor:
    """[num_slots, N]: row s = a[s // top_k if a_by_token else s] @ w[expert of s].T; a [rows, K] (unit stride
    along K), w [experts, N, K] (contiguous)."""
    n_len, k_len = w.shape[1], w.shape[2]
    assert a.stride(1) == 1 and w.is_contiguous() and a.dtype == w.dtype
    out = torch.empty((blocks.num_slots, n_len), dtype=a.dtype, device=a.device)
    fp32 = a.dtype == torch.float32
    block_n, block_k = (32, 32) if fp32 else (64, 64)
    grid = (len(blocks.experts), triton.cdiv(n_len, block_n))
    _grouped_matmul_kernel[grid](
        a, w, out, blocks.slots, blocks.experts, blocks.num_slots, n_len, k_len, a.stride(0), w.stride(0), w.stride(1),
        out.stride(0), TOP_K=top_k, A_BY_TOKEN=a_by_token, BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PREC="ieee" if fp32 else "tf32", num_warps=4,
    )  # fmt: skip
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
    """Every slot's expert output [T * k, hidden] in (token, choice) order: down(silu(gate x) * up x) with
    w13 [E, 2 * inter, hidden] (gate rows, then up rows) and w2 [E, hidden, inter]."""
    num_tokens, top_k = choices.shape
    blocks = align(choices, w13.shape[0], block_rows(num_tokens * top_k, w13.shape[0]))
    gate_up = grouped_matmul(x, w13, blocks, top_k, a_by_token=True)
    gate, up = gate_up.chunk(2, dim=-1)
    return grouped_matmul(torch.nn.functional.silu(gate) * up, w2, blocks, top_k, a_by_token=False)
