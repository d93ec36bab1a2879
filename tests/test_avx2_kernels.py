"""The AVX2 + FMA linears (csrc/linear_avx2.c, csrc/linear_quant_avx2.c, and csrc/linear_f32.c's AVX2 half), built
for x86-64-v3 and loaded beside this machine's own kernels: on an AVX512-BF16 CPU the engine never runs them, so they
are checked here on any CPU that has AVX2, against the fp32 matmul of the weights each format stands for. The bf16
linear of AVX-512 CPUs without AVX512-BF16 (csrc/linear_avx512.c), built for skylake-avx512, is checked against them
on any AVX-512 CPU."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from engine_core.cpu_kernels import CpuKernels, cpu_kernels
from engine_core.kernel_build import build_library, cpu_flags
from engine_core.linear_packing import pack_bf16, pack_f32, pack_int4, pack_int8
from engine_core.models.quant import dequantize, quantize_int4, quantize_int8

CC = shutil.which("cc") or shutil.which("gcc")
# x86-64-v3's instructions: AVX2, FMA, F16C, and the bit-manipulation ones gcc may use anywhere
V3_FLAGS = {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}
pytestmark = pytest.mark.skipif(CC is None or not V3_FLAGS.issubset(cpu_flags().split()),
                                reason="runs x86-64-v3 code (AVX2 + FMA), built with a C compiler")  # fmt: skip


# skylake-avx512's: AVX-512 F, CD, BW, DQ and VL besides x86-64-v3's, and the cache-line ones
SKYLAKE_FLAGS = V3_FLAGS | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "clflushopt", "clwb"}


@pytest.fixture(scope="module")
def avx2() -> CpuKernels:
    assert CC is not None
    kernels = CpuKernels(ctypes.CDLL(str(build_library(CC, "x86-64-v3"))))
    assert kernels.has_linear and kernels.has_int8_linear and kernels.has_int4_linear and kernels.has_f32_linear
    return kernels


@pytest.fixture(scope="module")
def avx512() -> CpuKernels:
    assert CC is not None
    return CpuKernels(ctypes.CDLL(str(build_library(CC, "skylake-avx512"))))


def packed_weight(fmt: str, weight: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed panels of `weight` in format `fmt`, and the fp32 weight they stand for: the kernel sums exact
    products of x and q in fp32, then scales them (unlike the AVX512-BF16 int8 kernel, which rounds q * scale to
    bf16 first)."""
    if fmt == "bf16":
        return pack_bf16(weight, cols), weight.float()
    if fmt == "int8":
        q, scale = quantize_int8(weight)
        return pack_int8(q, scale, cols), dequantize(q, scale)
    q, scale, mins = quantize_int4(weight)
    return pack_int4(q, scale, mins, cols), dequantize(q, scale, mins)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize(
    "out_features,in_features,bias",
    [(96, 64, False), (130, 1536, True), (20, 64, True), (100, 576, False), (40, 4096, True)],
)
def test_avx2_linears_match_fp32_and_each_row_is_computed_alone(avx2, fmt, out_features, in_features, bias) -> None:
    """130, 20 and 100 output columns end in a partial panel (3, 2 and 1 vectors of 16, the last one partial too);
    40 rows cross every tile shape (bf16: 2-row wide tiles up to 12 rows, then 6-row strips in L2-sized blocks, as
    at 4096 features; int8 and int4: one row over the whole panel, else 4- or 5-row tiles and their remainders
    over fewer columns, and past 32 rows from each panel widened once); strided rows. Every row comes out bit for
    bit the same alone as inside any batch, 32 rows unpacking as they go against 40 reading widened panels."""
    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    b = torch.randn(out_features, dtype=torch.bfloat16) if bias else None
    packed, w = packed_weight(fmt, weight, avx2.panel_cols)
    wide = torch.randn(40, in_features + 6, dtype=torch.bfloat16)
    x = wide[:, 1 : in_features + 1]  # rows strided by the wider width, and 2-byte aligned only
    out = avx2.linear(x, packed, b, out_features)
    ref = x.float() @ w.T + (0 if b is None else b.float())
    assert out.shape == (40, out_features) and out.dtype == torch.bfloat16
    # fp32 sums of exact products: off by the bf16 rounding of the result, and fp32 sums' order
    assert float((out.float() - ref).abs().max()) <= 2 * float(ref.abs().max()) * 2**-8 + 1e-3
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 32, 33):
        for start in (0, 40 - rows):
            assert torch.equal(avx2.linear(x[start : start + rows], packed, b, out_features), out[start : start + rows])


@pytest.mark.parametrize("out_features,in_features", [(96, 64), (130, 1536), (20, 35), (100, 576), (40, 4096)])
def test_avx2_fp32_linear_matches_float64_and_avx512_bit_for_bit(avx2, out_features, in_features) -> None:
    """One row over whole panels, more in 6-row strips of 16 columns, partial panels and strided rows: within fp32
    rounding of the exact sums, every row the same alone as in any batch, and, on a CPU with AVX-512, the same
    bits as the AVX-512 tiles: both add each output's products one after the other with FMAs."""
    torch.manual_seed(in_features)
    weight, b = torch.randn(out_features, in_features), torch.randn(out_features)
    packed = pack_f32(weight, avx2.panel_cols)
    x = torch.randn(40, in_features + 3)[:, 1 : in_features + 1]
    out = avx2.linear(x, packed, b, out_features)
    ref = x.double() @ weight.double().T + b.double()
    bound = in_features * 2**-23 * float((x.double().abs() @ weight.double().abs().T).max() + 1)
    assert out.dtype == torch.float32 and float((out.double() - ref).abs().max()) <= bound
    for rows in (1, 2, 5, 6, 7, 13, 33):
        for start in (0, 40 - rows):
            assert torch.equal(avx2.linear(x[start : start + rows], packed, b, out_features), out[start : start + rows])
    native = cpu_kernels()
    if native is not None and native.has_f32_linear:
        assert torch.equal(native.linear(x, packed, b, out_features), out)


@pytest.mark.skipif(not SKYLAKE_FLAGS.issubset(cpu_flags().split()), reason="runs skylake-avx512 code (AVX-512F)")
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (130, 1536), (20, 64), (100, 576), (40, 4096)])
def test_avx512_bf16_linear_is_avx2_bit_for_bit(avx2, avx512, out_features, in_features) -> None:
    """csrc/linear_avx512.c (8-row tiles over whole panels, 16 columns a vector) adds each output's products with
    the same FMAs in the same order as the AVX2 kernel, so every row count, partial panel (130, 20, 100 columns),
    L2-sized block of rows (4096 features) and strided row gives the same bits."""
    assert avx512.lib.linear_avx512_available() == 1 and avx2.lib.linear_avx512_available() == 0
    torch.manual_seed(in_features - out_features)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    b = torch.randn(out_features, dtype=torch.bfloat16) if out_features % 20 == 0 else None
    packed = pack_bf16(weight, avx2.panel_cols)
    x = torch.randn(300, in_features + 6, dtype=torch.bfloat16)[:, 1 : in_features + 1]
    for rows in (1, 2, 3, 7, 8, 9, 16, 17, 64, 300):
        rows_x = x[:rows]
        assert torch.equal(avx512.linear(rows_x, packed, b, out_features), avx2.linear(rows_x, packed, b, out_features))
