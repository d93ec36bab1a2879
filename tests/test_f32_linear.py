"""csrc/linear_f32.c, the fp32 linears on CPU (--dtype float32): against a float64 matmul, every row's bits
independent of the rows beside it, and the layers of an fp32 model (LoRA's too) packed for it at load."""

from __future__ import annotations

import pytest
import torch

from engine_core.cpu_kernels import cpu_kernels
from engine_core.linear_packing import pack_f32
from engine_core.lora import low_rank
from engine_core.models.layers import PackedLinear
from engine_core.models.quant import prepare_linears
from tests.cpu_features import needs_f32_linear_kernel

pytestmark = needs_f32_linear_kernel
CPU = torch.device("cpu")


def close_to_float64(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Within fp32 rounding of the exact sums: each output adds K products one after the other."""
    ref = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    scale = (x.double().abs() @ weight.double().abs().T).max() + 1
    return out.dtype == torch.float32 and float((out.double() - ref).abs().max()) <= x.shape[-1] * 2**-23 * scale


@pytest.mark.parametrize("out_features,in_features",
                         [(96, 64), (33, 1), (1000, 576), (48, 1536), (100, 35), (20, 64), (40, 4096)])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_f32_linear_matches_float64_and_each_row_is_computed_alone(out_features, in_features, bias) -> None:
    """Output widths off the 48-column panels and 16-column vectors, odd in_features (no pairs in fp32), row counts
    across the 8-row tiles, strided input rows; and every row bit for bit the same alone as inside any batch: what
    lets the engine run one row without padding and still draw a seeded request's tokens whatever runs beside it."""
    kernels = cpu_kernels()
    assert kernels is not None and kernels.supports_linear(torch.float32, in_features)
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features)
    b = torch.randn(out_features) if bias else None
    packed = pack_f32(weight, kernels.panel_cols)
    x = torch.randn(23, in_features + 5)[:, 2 : in_features + 2]  # rows strided by the wider width
    out = kernels.linear(x, packed, b, out_features)
    assert out.shape == (23, out_features)
    assert close_to_float64(out, x, weight, b)
    for rows in (1, 2, 3, 4, 7, 8, 9, 16, 17):
        for start in (0, 23 - rows):
            assert torch.equal(kernels.linear(x[start : start + rows], packed, b, out_features),
                               out[start : start + rows])  # fmt: skip


@pytest.mark.parametrize("out_features,in_features", [(16, 1536), (40, 576), (576, 16), (3072, 32)])
def test_a_prefills_rows_split_over_threads_change_no_bit(out_features, in_features) -> None:
    """A weight of a panel or two (a LoRA adapter's A or B) has its 1000 rows split over the threads: every row still
    comes out as alone; and the output ignores the panels' zero padding."""
    kernels = cpu_kernels()
    assert kernels is not None
    torch.manual_seed(1)
    weight = torch.randn(out_features, in_features)
    packed = pack_f32(weight, kernels.panel_cols)
    assert packed.numel() == -(-out_features // 16) * 16 * in_features
    x = torch.randn(1000, in_features)
    out = kernels.linear(x, packed, None, out_features)
    assert close_to_float64(out, x, weight, None)
    for start, rows in ((0, 1), (5, 8), (333, 17), (990, 10)):
        assert torch.equal(kernels.linear(x[start : start + rows], packed, None, out_features),
                           out[start : start + rows])  # fmt: skip


def test_an_fp32_model_packs_every_linear_and_needs_no_padding_rows() -> None:
    """prepare_linears on an fp32 CPU model: every linear (biased or not) becomes a PackedLinear our kernel runs,
    the model gives the plain layers' results to fp32 rounding, and the fewest rows a step needs is 1 (it was 8:
    MKL sums rows below 4 in another order)."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 40, bias=False))
    x = torch.randn(5, 64)
    with torch.inference_mode():
        expected = model(x)
        assert prepare_linears(model, "none", CPU, torch.float32) == 1
        assert all(isinstance(m, PackedLinear) and m.kernels is not None for m in (model[0], model[2]))
        assert torch.allclose(model(x), expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(model(x[3:4]), model(x)[3:4])


def test_fp32_lora_products_are_packed_too() -> None:
    """An adapter's A and B run on the same kernel as the layers they change: in fp32 a plain A at one row would
    be MKL's other summing order, and a seeded adapter request's tokens would depend on the batch."""
    torch.manual_seed(3)
    a, b = torch.randn(8, 64), torch.randn(96, 8)
    update = low_rank(a, b, CPU, torch.float32)
    assert all(isinstance(m, PackedLinear) and m.kernels is not None for m in update)
    x = torch.randn(9, 64)
    with torch.inference_mode():
        out = update(x)
        assert torch.allclose(out, x @ a.T @ b.T, atol=1e-4, rtol=1e-4)
        assert torch.equal(update(x[4:5]), out[4:5])
