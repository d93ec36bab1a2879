"""The grouped-matmul experts of a mixture of experts on CUDA (engine_core/models/moe_triton.py) against the experts
run one by one in torch. On CUDA they run natively; without it, in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), on small shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_core.models import moe_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def random_choices(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    """Each token's top_k distinct experts, as a router's topk gives them."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(DEVICE)


@pytest.mark.parametrize("tokens, top_k, experts, block_m", [(1, 2, 8, 16), (7, 3, 5, 16), (40, 4, 6, 32)])
def test_align_puts_every_slot_once_in_a_block_of_its_expert(tokens, top_k, experts, block_m) -> None:
    choices = random_choices(tokens, top_k, experts, seed=tokens)
    blocks = moe_triton.align(choices, experts, block_m)
    num_slots = tokens * top_k
    slots = blocks.slots.view(-1, block_m).cpu()
    block_experts = blocks.experts.cpu()
    flat = choices.flatten().cpu()
    seen = []
    for block, expert in zip(slots, block_experts.tolist(), strict=True):
        real = block[block < num_slots]
        if expert < 0:
            assert len(real) == 0
            continue
        assert len(real) > 0 and (flat[real] == expert).all()  # the block's slots all chose its expert
        assert (real == real.sort().values).all() and (block[: len(real)] == real).all()  # in order, padding last
        seen += real.tolist()
    assert sorted(seen) == list(range(num_slots))
    counts = torch.bincount(flat, minlength=experts)
    assert (block_experts >= 0).sum() == sum(-(-int(c) // block_m) for c in counts)  # no block without work


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, top_k", [(1, 2), (9, 3), (70, 2)])
def test_fused_experts_equal_the_experts_one_by_one(dtype: torch.dtype, tokens: int, top_k: int) -> None:
    """Hidden and intermediate sizes that are not multiples of the tiles (the masks), experts nobody chose, and
    (at 70 tokens) blocks of 32 rows."""
    experts, hidden, inter = 6, 48, 40
    gen = torch.Generator().manual_seed(tokens)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).to(DEVICE, dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    choices = random_choices(tokens, top_k, experts - 1, seed=tokens + 1)  # expert 5 is never chosen
    out = moe_triton.fused_experts(x, w13, w2, choices)
    assert out.shape == (tokens * top_k, hidden) and out.dtype == dtype
    for slot, expert in enumerate(choices.flatten().tolist()):
        gate, up = (x[slot // top_k].float() @ w13[expert].float().T).chunk(2)
        ref = (F.silu(gate) * up) @ w2[expert].float().T
        assert (out[slot].float() - ref).abs().max() < TOL[dtype] * max(1.0, ref.abs().max().item()), slot


@pytest.mark.parametrize("arch", ["qwen2-moe", "mixtral"])
def test_stacked_experts_load_from_the_checkpoint(arch: str, tmp_path) -> None:
    """On a GPU each expert's linears are views into the stacked w13 and w2 (SparseMoe._stack_experts), filled by
    loading the checkpoint (Mixtral's names too): the grouped kernels over them equal the experts run one by one."""
    from engine_core.models.loader import build_model, load_weights
    from engine_core.models.moe import SparseMoe
    from tests.test_moe import tiny_moe

    hf = tiny_moe(arch)
    hf.save_pretrained(tmp_path)
    model = build_model(hf.config, torch.float32, torch.device("cpu"), 128)
    layers = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoe)]
    for moe in layers:
        moe._stack_experts()  # as SparseMoe does when built on a GPU
    load_weights(model, tmp_path)
    gen = torch.Generator().manual_seed(0)
    for moe in layers:
        x = torch.randn(11, hf.config.hidden_size, generator=gen)
        choices, _ = moe.route(x)
        assert moe.w13 is not None and moe.w2 is not None
        fused = moe_triton.fused_experts(x, moe.w13, moe.w2, choices)
        assert (fused - moe._run_experts(x, choices)).abs().max() < 1e-4
