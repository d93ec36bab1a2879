"""The fused elementwise CPU kernels (csrc/layers.c) against the torch path they replace."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig

from engine_core.cpu_kernels import cpu_kernels
from engine_core.linear_packing import pack_bf16
from engine_core.models import layers
from engine_core.models.layers import (
    GemmaRMSNorm,
    RMSNorm,
    RotaryEmbedding,
    StepRotary,
    gelu_tanh_and_mul,
    silu_and_mul,
)
from tests.cpu_features import needs_linear_kernels

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]
GELU_U = (2 / torch.pi) ** 0.5  # GELU's tanh approximation: 0.5 x (1 + tanh(GELU_U (x + 0.044715 x^3)))
ONEDNN_BF16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.fixture
def torch_path(monkeypatch):
    """Calls fn with the kernels switched off (the torch reference)."""

    def run(fn):
        with monkeypatch.context() as m:
            m.setattr(layers, "cpu_kernels", lambda: None)
            return fn()

    assert cpu_kernels() is not None, "the C compiler is part of the supported setup; the kernels must build"
    return run


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows crosses the threshold for using threads
def test_rms_norm_with_and_without_residual(torch_path, dtype, tol, rows) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(rows, 576, dtype=dtype) * 3, torch.randn(rows, 576, dtype=dtype)
    assert close(norm(x), torch_path(lambda: norm(x)), tol)
    ref_out, ref_residual = torch_path(lambda: norm(x, residual.clone()))
    kernel_residual = residual.clone()
    out, new_residual = norm(x, kernel_residual)
    assert new_residual is kernel_residual  # updated in place for the next layer
    assert close(out, ref_out, tol) and close(new_residual, ref_residual, tol)
    assert torch.equal(new_residual, x + residual)  # one rounding of the sum, as in torch


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("rows", [1, 300])
def test_gemma_rms_norm_scales_by_one_plus_weight(torch_path, dtype, tol, rows) -> None:
    torch.manual_seed(0)
    norm = GemmaRMSNorm(640, 1e-6).to(dtype)
    norm.weight.data.uniform_(-0.5, 0.5)  # Gemma's checkpoints store the weight minus one
    x = torch.randn(rows, 640, dtype=dtype) * 3
    ours, reference = norm(x), torch_path(lambda: norm(x))
    assert close(ours, reference, tol)
    if dtype == torch.bfloat16:  # one rounding to bf16, in the same place: only rare near-ties differ
        assert (ours == reference).float().mean() > 0.99


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("rows", [1, 64, 129])
@pytest.mark.parametrize("act_and_mul", [silu_and_mul, gelu_tanh_and_mul])
def test_act_and_mul(torch_path, dtype, tol, rows, act_and_mul) -> None:
    """Against float64 math rounded where the kernel rounds (the activation, then the product), and against torch,
    whose GELU loses digits where 1 + tanh cancels (gates below about -3): ours is written as x sigmoid(2u)."""
    torch.manual_seed(0)
    x = torch.randn(rows, 2 * 1536, dtype=dtype) * 4
    ours = act_and_mul(x)
    gate, up = x.double().chunk(2, dim=-1)
    act = gate * torch.sigmoid(gate if act_and_mul is silu_and_mul else 2 * GELU_U * (gate + 0.044715 * gate**3))
    if dtype == torch.bfloat16:
        assert (ours == (act.to(dtype).double() * up).to(dtype)).float().mean() > 0.99
    else:
        assert close(ours, (act * up).to(dtype), tol)
    assert close(ours, torch_path(lambda: act_and_mul(x)), 1e-2)


@pytest.mark.parametrize("width", [100, 7])
def test_bf16_norm_and_activation_of_widths_off_the_vector(torch_path, width) -> None:
    """With AVX512-BF16 the bf16 RMSNorm and activations take 16 values at a time: a row whose width is not a
    multiple of 16 ends in a masked part, which must give what the rest of the row gets."""
    torch.manual_seed(1)
    norm = RMSNorm(width, 1e-5).to(torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(300, width, dtype=torch.bfloat16) * 3, torch.randn(300, width, dtype=torch.bfloat16)
    ref_out, ref_residual = torch_path(lambda: norm(x, residual.clone()))
    out, new_residual = norm(x, residual.clone())
    assert torch.equal(new_residual, ref_residual) and close(out, ref_out, 2e-2)
    gates = torch.randn(300, 2 * width, dtype=torch.bfloat16) * 4
    gate, up = gates.double().chunk(2, dim=-1)
    exact = ((gate * torch.sigmoid(gate)).to(torch.bfloat16).double() * up).to(torch.bfloat16)
    assert (silu_and_mul(gates) == exact).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_and_mul", [silu_and_mul, gelu_tanh_and_mul])
def test_act_and_mul_of_very_negative_gates_is_zero_not_nan(dtype, act_and_mul) -> None:
    """exp(-gate) overflows below -88; -ffast-math's division by infinity then gave NaN (SwiGLU had this bug)."""
    gate = torch.linspace(-300, 20, 1536).to(dtype)
    out = act_and_mul(torch.cat([gate, torch.full_like(gate, 3.0)]).reshape(1, -1))
    assert not out.isnan().any()
    assert out[0, gate < -100].abs().max().item() < 1e-30
    assert out[0, -1].item() == pytest.approx(60.0, rel=1e-2)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rotary_rotates_q_and_k_heads_in_place_inside_qkv(torch_path, dtype, tol) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0)
    rotary = RotaryEmbedding(config, 64, max_positions=4096)
    positions = torch.tensor([0, 1, 5, 17, 300, 4095, 2])
    qkv = torch.randn(len(positions), (9 + 3 + 3) * 64, dtype=dtype)
    original = qkv.clone()
    expected = torch_path(lambda: StepRotary(rotary, positions, dtype)(qkv[:, : 12 * 64].reshape(-1, 12, 64).clone()))
    view = qkv[:, : 12 * 64].view(-1, 12, 64)  # strided rows: the qkv width, not the q+k width
    out = StepRotary(rotary, positions, dtype)(view)
    assert out.data_ptr() == view.data_ptr()
    assert close(out, expected, tol)
    assert torch.equal(qkv[:, 12 * 64 :], original[:, 12 * 64 :])  # v untouched
    assert torch.equal(out[0], original[0, : 12 * 64].view(12, 64))  # position 0 is the identity rotation


@needs_linear_kernels
def test_packed_linears_match_the_float_matmul_and_onednn_packing_is_exact(torch_path) -> None:
    """bf16 on CPU: every linear of a model swapped for its packed form. Our kernel's bf16 outputs round fp32 sums
    of the same products; where it is not built, the oneDNN-packed form (or the plain weight, where oneDNN has no
    bf16 path) gives the plain layer's bits."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32, bias=False))
    model = model.to(torch.bfloat16)
    inputs = [torch.randn(rows, 64, dtype=torch.bfloat16) for rows in (1, 7, 64, 300)]
    with torch.inference_mode():
        expected = [model(x) for x in inputs]
        in_fp32 = [model.float()(x.float()) for x in inputs]
        model = model.to(torch.bfloat16)
        onednn = copy.deepcopy(model)
        assert torch_path(lambda: layers.pack_linears(onednn)) == 2
        assert layers.pack_linears(model) == 2
        assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
        assert all(m.kernels is not None for m in model.modules() if isinstance(m, layers.PackedLinear))
        # Without oneDNN's bf16 path (AVX2 CPUs) the fallback keeps the plain weight: the same bits either way.
        assert all(m.onednn == ONEDNN_BF16 for m in onednn.modules() if isinstance(m, layers.PackedLinear))
        for x, ref, ref32 in zip(inputs, expected, in_fp32, strict=True):
            assert torch.equal(onednn(x), ref)
            assert close(model(x), ref32.to(torch.bfloat16), 2e-2)


@needs_linear_kernels
@pytest.mark.parametrize("out_features,in_features",
                         [(96, 64), (33, 2), (1000, 576), (48, 1536), (100, 34), (20, 64), (40, 4096)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_matches_fp32_and_each_row_is_computed_alone(out_features, in_features, bias) -> None:
    """csrc/linear.c in bf16 against the fp32 matmul, for output widths off its 48-column panels and 16-column
    vectors, row counts across its tiles (8 rows with AVX512-BF16; with AVX2, up to 12 rows 2 at a time over whole
    panels, more 6 at a time in strips, in blocks of rows whose widened x fits L2: 12 rows at 4096 features), and
    strided input rows; and every row bit for bit the same alone as inside any batch: what makes seeded sampling
    independent of the batch (see prepare_linears)."""
    kernels = cpu_kernels()
    assert kernels is not None and kernels.supports_linear(torch.bfloat16, in_features)
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    b = torch.randn(out_features, dtype=torch.bfloat16) if bias else None
    packed = pack_bf16(weight, kernels.panel_cols)
    wide = torch.randn(23, in_features + 6, dtype=torch.bfloat16)
    x = wide[:, 1 : in_features + 1]  # rows strided by the wider width, and 2-byte aligned only
    out = kernels.linear(x, packed, b, out_features)
    ref = x.float() @ weight.float().T + (0 if b is None else b.float())
    assert out.shape == (23, out_features)
    assert torch.allclose(out.float(), ref, atol=0.02 * float(ref.abs().max()), rtol=1e-2)
    assert float((out.float() - ref).abs().max()) <= 2 * float(ref.abs().max()) * 2**-8 + 1e-3
    for rows in (1, 2, 3, 4, 7, 8, 9, 16, 17):
        for start in (0, 23 - rows):
            alone = kernels.linear(x[start : start + rows], packed, b, out_features)
            assert torch.equal(alone, out[start : start + rows])


@needs_linear_kernels
@pytest.mark.parametrize("out_features,in_features",
                         [(16, 1536), (32, 576), (40, 576), (576, 16), (3072, 32), (96, 64)])  # fmt: skip
def test_a_prefills_rows_over_a_skinny_weight_split_over_threads_change_no_bit(out_features, in_features) -> None:
    """LoRA's shapes (an A of 16 to 48 columns, a B over a rank's few k) at a prefill's rows: a weight of a panel or
    two has its rows split over the threads too, and every row still comes out bit for bit as alone."""
    kernels = cpu_kernels()
    assert kernels is not None
    torch.manual_seed(1)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    packed = pack_bf16(weight, kernels.panel_cols)
    x = torch.randn(1000, in_features, dtype=torch.bfloat16)
    out = kernels.linear(x, packed, None, out_features)
    ref = x.float() @ weight.float().T
    assert float((out.float() - ref).abs().max()) <= 2 * float(ref.abs().max()) * 2**-8 + 1e-3
    for start, rows in ((0, 1), (5, 8), (333, 17), (990, 10), (0, 1000)):
        assert torch.equal(kernels.linear(x[start : start + rows], packed, None, out_features),
                           out[start : start + rows])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 5), (3, 16), (64, 49152), (7, 1000), (2, 33)])
def test_argmax_rows_matches_torch_first_index_on_ties(dtype, rows, cols) -> None:
    kernels = cpu_kernels()
    assert kernels is not None
    torch.manual_seed(0)
    x = torch.randn(rows, cols).to(dtype)
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))
    # Ties: the maximum planted at several places, in the vector part and in the scalar tail.
    for where in ([0, cols - 1], [cols // 2, cols - 1], [cols - 2, cols - 1]):
        tied = x.clone()
        tied[:, where] = 100.0
        assert kernels.argmax_rows(tied).tolist() == [min(where)] * rows
