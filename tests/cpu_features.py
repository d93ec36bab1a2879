"""Which of our C kernels this CPU runs. The bf16, fp32, int8 and int4 linears, the decode stack and the prefill
attention need AVX-512 (AVX512-BF16 for the bf16 and quantized linears) or AVX2 with FMA (and F16C for int8 and
int4); on a CPU without them the engine runs torch there, so tests of those kernels skip, as the CUDA-only tests
skip on CPU, and tests of the engine expect the torch path."""

from __future__ import annotations

import pytest

from engine_core.cpu_kernels import cpu_kernels

_KERNELS = cpu_kernels()
HAS_LINEAR = _KERNELS is not None and _KERNELS.has_linear
HAS_INT8_LINEAR = _KERNELS is not None and _KERNELS.has_int8_linear
HAS_INT4_LINEAR = _KERNELS is not None and _KERNELS.has_int4_linear
HAS_PREFILL = _KERNELS is not None and _KERNELS.has_prefill
HAS_F32_LINEAR = _KERNELS is not None and _KERNELS.has_f32_linear
HAS_AMX_LINEAR = _KERNELS is not None and _KERNELS.has_amx_linear

needs_amx = pytest.mark.skipif(not HAS_AMX_LINEAR, reason="the AMX linears need an AMX CPU (Sapphire Rapids or later)")
needs_linear_kernels = pytest.mark.skipif(not HAS_LINEAR,
                                          reason="our linear kernels need AVX512-BF16 or AVX2 + FMA")  # fmt: skip
needs_prefill_kernel = pytest.mark.skipif(not HAS_PREFILL,
                                          reason="the prefill kernel needs AVX512F or AVX2 + FMA")  # fmt: skip
needs_int8_kernels = pytest.mark.skipif(not HAS_INT8_LINEAR,
                                        reason="our int8 linear kernels need AVX512-BF16 or AVX2 + FMA")  # fmt: skip
needs_int4_kernels = pytest.mark.skipif(not HAS_INT4_LINEAR,
                                        reason="our int4 linear kernels need AVX512-BF16 or AVX2 + FMA")  # fmt: skip
needs_f32_linear_kernel = pytest.mark.skipif(not HAS_F32_LINEAR,
                                             reason="our fp32 linear kernel needs AVX-512 or AVX2 + FMA")  # fmt: skip
HAS_FP8_DECODE = _KERNELS is not None and _KERNELS.has_fp8_decode
needs_fp8_decode = pytest.mark.skipif(not HAS_FP8_DECODE,
                                      reason="fp8 KV decode attention needs AVX512-BF16 or AVX2")  # fmt: skip
