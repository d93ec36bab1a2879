"""The AMX kernels. csrc/linear_amx.c: linears on AMX tiles, reading the AVX-512 kernels' panels. Every call whose
k is a multiple of 32 runs there on an AMX CPU, bf16, int8 or int4 (tests/test_cpu_kernels.py's and
tests/test_quantization.py's linear tests then check it too); here, rows across its 16-row blocks and the threads,
panels of 1 to 3 vectors, inputs past L2 (taken in groups of panels), quantized panels widened as they go or once,
and ROSEINFER_AMX=0, which keeps every call on the AVX-512 tiles. csrc/attend_amx.c: bf16 prefill attention tiles,
which tests/test_attention.py's prefill tests check on an AMX CPU. With ROSEINFER_AMX=0, those attention and linear
tests again, for csrc/attend_bf16.c, csrc/linear.c and csrc/linear_int4.c. csrc/glu_amx.c: a gated MLP's gate_up
linear and activation in one call, bit for bit the two calls it replaces."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_core.cpu_kernels import cpu_kernels
from engine_core.linear_packing import pack_bf16, pack_int4, pack_int8
from engine_core.models.quant import dequantize, quantize_int4, quantize_int8
from tests.cpu_features import needs_amx

# 100 columns: panels of 48, 48 and 4 (one vector); k 96: three 32-k steps; 70 rows: four 16-row blocks and 6.
OUT, IN, ROWS = 100, 96, 70


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    weight = torch.randn(OUT, IN, dtype=torch.bfloat16)
    bias = torch.randn(OUT, dtype=torch.bfloat16)
    x = torch.randn(ROWS, IN + 32, dtype=torch.bfloat16)[:, 16 : 16 + IN]  # strided rows
    return weight, bias, x, x.float() @ weight.float().T + bias.float()


@needs_amx
def test_amx_rows_match_fp32_and_each_row_is_computed_alone() -> None:
    kernels = cpu_kernels()
    assert kernels is not None and kernels.has_amx_linear
    weight, bias, x, ref = _case()
    packed = pack_bf16(weight, kernels.panel_cols)
    out = kernels.linear(x, packed, bias, OUT)
    assert float((out.float() - ref).abs().max()) <= 2 * float(ref.abs().max()) * 2**-8 + 1e-3
    for start, rows in ((0, 1), (3, 15), (15, 2), (16, 16), (30, 40), (69, 1)):
        assert torch.equal(kernels.linear(x[start : start + rows], packed, bias, OUT), out[start : start + rows])
    many = torch.randn(2000, IN, dtype=torch.bfloat16)  # split over the threads by rows and panels
    wide = kernels.linear(many, packed, bias, OUT)
    assert torch.equal(kernels.linear(many[1234:1251], packed, bias, OUT), wide[1234:1251])


@needs_amx
@pytest.mark.parametrize("out_features", [2000, 96])
def test_amx_rows_beyond_l2_take_groups_of_panels_and_change_no_bit(out_features) -> None:
    """600 rows of k 1024 (1.2 MB of x, past the kernel's 1 MB) go a group of panels at a time, each 16-row block
    across the group: 2000 columns make several groups per thread, 96 (two panels) split each panel's rows between
    the threads. Each row still equals the fp32 product within bf16 rounding, and itself computed alone."""
    torch.manual_seed(5)
    kernels = cpu_kernels()
    assert kernels is not None and kernels.has_amx_linear
    weight = torch.randn(out_features, 1024, dtype=torch.bfloat16)
    x = torch.randn(600, 1024, dtype=torch.bfloat16)
    packed = pack_bf16(weight, kernels.panel_cols)
    out = kernels.linear(x, packed, None, out_features)
    ref = x.float() @ weight.float().T
    assert float((out.float() - ref).abs().max()) <= 2 * float(ref.abs().max()) * 2**-8
    for start, rows in ((0, 16), (100, 3), (587, 13)):
        assert torch.equal(kernels.linear(x[start : start + rows], packed, None, out_features),
                           out[start : start + rows])  # fmt: skip


@needs_amx
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("out_features,k,rows", [(100, 96, 70), (2000, 1024, 600), (96, 1024, 600)])
def test_quantized_panels_on_amx_keep_each_rows_bits_alone(method, out_features, k, rows) -> None:
    """int8 and int4 calls run on AMX too, widened to bf16 tiles: a call of one 16-row block widens each 32-k chunk
    as it goes, a longer call each panel once (past 1 MB of x, a group of panels at a time). Each row equals the
    product with the dequantized weight (int8 rounds each weight to bf16, int4 sums x times the exact q and then
    scales), and is the same bits computed alone or in any block of a longer call."""
    torch.manual_seed(11)
    kernels = cpu_kernels()
    assert kernels is not None and kernels.has_amx_linear
    weight = torch.randn(out_features, k, dtype=torch.bfloat16)
    parts = quantize_int8(weight) if method == "int8" else quantize_int4(weight)
    packed = pack_int8(*parts, kernels.panel_cols) if method == "int8" else pack_int4(*parts, kernels.panel_cols)
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    x = torch.randn(rows, k + 32, dtype=torch.bfloat16)[:, 16 : 16 + k]  # strided rows
    out = kernels.linear(x, packed, bias, out_features)
    ref = x.float() @ dequantize(*parts).T + bias.float()
    assert float((out.float() - ref).abs().max()) <= 4 * float(ref.abs().max()) * 2**-8
    for start, count in ((0, 1), (3, 15), (15, 2), (16, 16), (rows - 7, 7), (rows // 2, 17)):
        assert torch.equal(kernels.linear(x[start : start + count], packed, bias, out_features),
                           out[start : start + count])  # fmt: skip


@needs_amx
def test_roseinfer_amx_0_keeps_the_avx512_tiles() -> None:
    code = ("import torch; from engine_core.cpu_kernels import cpu_kernels; from engine_core.linear_packing import "
            "pack_bf16; from tests.test_amx import _case, OUT; k = cpu_kernels(); w, b, x, ref = _case(); "
            "out = k.linear(x, pack_bf16(w, k.panel_cols), b, OUT); "
            "print(k.has_amx_linear, float((out.float() - ref).abs().max()) / float(ref.abs().max()), "
            "k.linear_glu(x, pack_bf16(w[:96], k.panel_cols), None, 48, 'silu') is None)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ROSEINFER_AMX": "0"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    amx, error, no_glu = proc.stdout.split()
    assert amx == "False" and float(error) <= 2 * 2**-8 and no_glu == "True"


@needs_amx
@pytest.mark.parametrize(
    "test_file,selection",
    [("tests/test_attention.py", "prefill"),
     ("tests/test_quantization.py", "quantized_linear_matches or rows_padded"),
     ("tests/test_cpu_kernels.py", "linear"),
     ("tests/test_grid_weights.py", "sum_as")],
)  # fmt: skip
def test_roseinfer_amx_0_runs_the_kernel_tests_on_avx512(test_file, selection) -> None:
    """Every AVX512-BF16 CPU without AMX takes csrc/attend_bf16.c for prefill attention and csrc/linear.c's and
    csrc/linear_int4.c's tiles for linears (grid panels too), which an AMX CPU never reaches: run their tests here
    with AMX off."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", selection],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent,
                          env={**os.environ, "ROSEINFER_AMX": "0"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "deselected" in summary, summary


@needs_amx
@pytest.mark.parametrize("rows,k,half,bias,act", [(70, 96, 80, True, "silu"), (600, 1024, 48, False, "gelu_tanh"),
                                                  (1, 64, 16, False, "silu"), (33, 576, 1536, True, "silu")])
def test_fused_glu_is_the_linear_then_act_and_mul_bit_for_bit(rows, k, half, bias, act) -> None:
    """Gate and up vectors in any panels (half = 80: five vectors, up starting mid-panel), whole pairs of 16-row
    blocks and the rows left over, 600 rows of k 1024 in groups (x past 1 MB), with and without a bias; each row
    also alone."""
    torch.manual_seed(7)
    kernels = cpu_kernels()
    assert kernels is not None and kernels.has_amx_linear
    weight = torch.randn(2 * half, k, dtype=torch.bfloat16) * 0.3
    b = torch.randn(2 * half, dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, k + 32, dtype=torch.bfloat16)[:, 16 : 16 + k]  # strided rows
    packed = pack_bf16(weight, kernels.panel_cols)
    fused = kernels.linear_glu(x, packed, b, half, act)
    assert fused is not None and fused.shape == (rows, half)
    assert torch.equal(fused, kernels.act_and_mul(kernels.linear(x, packed, b, 2 * half), act))
    for start, count in ((0, 1), (rows // 2, 1), (rows - 1, 1)):
        alone = kernels.linear_glu(x[start : start + count], packed, b, half, act)
        assert torch.equal(alone, fused[start : start + count])
