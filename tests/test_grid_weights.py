"""Linear weights a GGUF stored on a 4- or 8-bit grid keep that grid in their panels when served in bf16
(engine_core/models/grid_weights.py): the kernels widen it back to the very bf16 weights, so every sum is the bf16
panels' bit for bit, from a third of the bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine_core.core import EngineCore
from engine_core.cpu_kernels import cpu_kernels
from engine_core.linear_packing import pack_bf16, pack_int4_as_bf16, pack_int8
from engine_core.models.grid_weights import find_grid
from engine_core.models.layers import PackedLinear
from tests.engine_helpers import fp32_config, greedy_request, mixed_prompts, run_engine

_KERNELS = cpu_kernels()
needs_grid_kernels = pytest.mark.skipif(_KERNELS is None or not _KERNELS.has_grid_linear,
                                        reason="grid panels are summed as bf16 only with AVX512-BF16")  # fmt: skip


def q4_1(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight as a Q4_1 GGUF dequantizes to: per 32 of a row, fp16 scale d and min m, w = d q + m, the
    group's least and largest q present (as the quantizer makes them)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(rows, k // 32, generator=g) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(rows, k // 32, generator=g) * 0.08).half().float()
    q = torch.randint(0, 16, (rows, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    return (q * d[..., None] + m[..., None]).view(rows, k)


def q4_0(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """As a Q4_0 GGUF dequantizes: w = d (q - 8), fp16 d of either sign per 32, the group's largest magnitude at
    q = 0 (llama.cpp's quantizer sets d = that weight / -8), the largest q often below 15."""
    g = torch.Generator().manual_seed(seed)
    d = ((torch.rand(rows, k // 32, generator=g) - 0.5) * 0.02).half().float()
    q = torch.randint(0, 13, (rows, k // 32, 32), generator=g).float()
    q[..., 0] = 0
    return ((q - 8) * d[..., None]).view(rows, k)


def q4_k(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """As a Q4_K GGUF dequantizes: per 256 of a row fp16 d and dmin, per 32 of them 6-bit sc and m, w = (d sc) q -
    dmin m, with q short of 15 in most groups (the K quantizer fits each group's scale and min itself): the first
    fit (range / 15) misses those, the gap fit takes them."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(rows, k // 256, 1, generator=g) * 1e-3 + 1e-4).half().float()
    dmin = (torch.rand(rows, k // 256, 1, generator=g) * 1e-3 + 1e-4).half().float()
    sc = torch.randint(1, 64, (rows, k // 256, 8), generator=g).float()
    m = torch.randint(0, 64, (rows, k // 256, 8), generator=g).float()
    top = torch.randint(5, 16, (rows, k // 256, 8, 1), generator=g)  # the group's largest q
    q = (torch.rand(rows, k // 256, 8, 32, generator=g) * (top + 1)).floor().clamp(max=top).float()
    q[..., 0], q[..., 1], q[..., 2] = 0, top[..., 0].float(), 1  # both ends, and two neighbouring levels
    return ((d * sc)[..., None] * q - (dmin * m)[..., None]).view(rows, k)


def q8_0(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """As a Q8_0 GGUF dequantizes: w = d q, fp16 d per 32, |q| <= 127 with 127 reached."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(rows, k // 32, generator=g) * 1e-3 + 1e-4).half().float()
    q = torch.randint(-127, 128, (rows, k // 32, 32), generator=g).float()
    q[..., 0] = -127
    return (q * d[..., None]).view(rows, k)


@needs_grid_kernels
@pytest.mark.parametrize("make,method,out_features,k", [(q4_1, "int4", 200, 576), (q4_1, "int4", 48, 64),
                                                        (q4_1, "int4", 80, 128),
                                                        (q4_1, "int4", 576, 1536), (q8_0, "int8", 130, 576),
                                                        (q4_0, "int4", 96, 256), (q4_k, "int4", 200, 512)])
def test_grid_panels_sum_as_their_bf16_weights(make, method, out_features, k) -> None:
    weight = make(out_features, k)
    found = find_grid(weight)
    assert found is not None and found[0] == method
    packed = (pack_int4_as_bf16 if method == "int4" else pack_int8)(*found[1], _KERNELS.panel_cols)
    assert torch.equal(_KERNELS.widen(packed, out_features, k), weight.bfloat16())
    plain = pack_bf16(weight.bfloat16(), _KERNELS.panel_cols)
    assert packed.numel() * packed.element_size() < plain.numel() * plain.element_size() * (0.4 if method == "int4"
                                                                                               else 0.65)  # fmt: skip
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    for rows in (1, 3, 8, 9, 16, 17, 64, 130):  # one tile or block of rows, several, widened once per panel
        x = torch.randn(rows, k + 32, dtype=torch.bfloat16)[:, 16 : 16 + k]  # strided rows
        assert torch.equal(_KERNELS.linear(x, packed, bias, out_features),
                           _KERNELS.linear(x, plain, bias, out_features)), rows  # fmt: skip


@needs_grid_kernels
def test_weights_off_every_grid_stay_bf16() -> None:
    assert find_grid(torch.randn(64, 128)) is None  # a trained float weight
    nudged = q4_1(64, 128)
    step_up = torch.nextafter(nudged[40, 70].bfloat16(), torch.tensor(1.0, dtype=torch.bfloat16))
    nudged[40, 70] = step_up.float()  # one bf16 step off its grid point
    assert find_grid(nudged) is None
    assert find_grid(q4_1(64, 128).bfloat16()) is None  # only float32 tensors are looked at: bf16 lost the grid
    assert find_grid(q4_1(64, 128)[:, :112]) is None  # k not a multiple of 32
    # Q8_0 is no Q4_1: the int4 grid misses, the int8 one is found
    assert find_grid(q8_0(64, 128))[0] == "int8"
    # Q4_0's groups are fitted their own way, also among Q4_1's in one weight (rows of each, groups of each)
    mixed = torch.cat([q4_1(32, 128, seed=1), q4_0(32, 128, seed=2)])
    mixed[:, 64:96] = q4_0(64, 128, seed=3)[:, 64:96]
    found = find_grid(mixed)
    assert found is not None and found[0] == "int4"
    assert torch.equal(_KERNELS.widen(pack_int4_as_bf16(*found[1], _KERNELS.panel_cols), 64, 128), mixed.bfloat16())


@needs_grid_kernels
def test_a_packed_linear_reads_its_grid_for_few_rows_only() -> None:
    """Up to grid_rows rows read the grid panels, more the bf16 ones (and a merged gate_up's fused activation, on
    AMX; no other CPU has it): every row count gives the plain linear's bits."""
    weight = q4_1(2 * 96, 128, seed=5)
    linear = nn.Linear(128, 2 * 96, bias=False, dtype=torch.bfloat16)
    linear.weight.data.copy_(weight)
    found = find_grid(weight)
    assert found is not None and found[0] == "int4"
    grid = PackedLinear(linear, pack_int4_as_bf16(*found[1], _KERNELS.panel_cols))
    plain = PackedLinear(linear)
    assert grid.packed_few is not None and grid.packed_few.dtype == torch.int16 and plain.packed_few is None
    assert torch.equal(grid.packed_weight, plain.packed_weight)
    for rows in (1, 5, _KERNELS.grid_rows, _KERNELS.grid_rows + 1, 64):
        x = torch.randn(rows, 128, dtype=torch.bfloat16)
        assert torch.equal(grid(x), plain(x)), rows
        assert (grid._panels(x) is grid.packed_few) == (rows <= _KERNELS.grid_rows)
        fused, expected = grid.glu(x, "silu"), plain.glu(x, "silu")  # None where the CPU has no fused kernel
        if rows <= _KERNELS.grid_rows or expected is None:
            assert fused is None
        else:
            assert fused is not None and torch.equal(fused, expected)


def _greedy() -> tuple[EngineCore, list[tuple[list[int], list[float]]]]:
    """Greedy tokens and logprobs, the prompts' too: 4 prompts at once (decode steps of 4 rows, on the grid) and
    their prefills (bf16 panels)."""
    core = EngineCore(fp32_config(dtype="bfloat16", max_num_batched_tokens=256))
    prompts = mixed_prompts()[::4]
    reqs = [greedy_request(f"p{i}", p, 12, logprobs=2, prompt_logprobs=0) for i, p in enumerate(prompts)]
    results = run_engine(core, reqs)
    runs = [([t for o in results[r.request_id] for t in o.new_token_ids],
             [x for o in results[r.request_id] for x in o.new_logprobs.token_logprobs]
             + results[r.request_id][0].prompt_logprobs.token_logprobs) for r in reqs]  # fmt: skip
    return core, runs


@needs_grid_kernels
def test_the_default_model_keeps_its_q4_1_grid_and_its_logits(monkeypatch) -> None:
    """Its GGUF holds every layer matrix as Q4_1 and the embedding (the tied head) as Q8_0: in bf16 every linear
    keeps its grid, and greedy tokens and logprobs (prompts' and outputs') equal the plain bf16 panels' exactly."""
    core, kept = _greedy()
    linears = [m for m in core.runner.model.modules() if isinstance(m, PackedLinear)]
    assert core.runner.model.lm_head.packed_few.dtype == torch.int8
    assert {m.packed_few.dtype for m in linears if m is not core.runner.model.lm_head} == {torch.int16}
    assert {m.packed_weight.dtype for m in linears} == {torch.bfloat16}
    monkeypatch.setenv("ROSEINFER_GRID_WEIGHTS", "0")
    plain_core, plain = _greedy()
    assert all(m.packed_few is None for m in plain_core.runner.model.modules() if isinstance(m, PackedLinear))
    assert kept == plain
