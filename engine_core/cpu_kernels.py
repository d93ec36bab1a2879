"""Our compiled CPU kernels (csrc/*.c), called through ctypes: linears, decode and prefill attention over paged
KV, the fused elementwise layers, sampling.

Built once per machine (engine_core/kernel_build.py). `cpu_kernels()` is None when there is no compiler (or
ROSEINFER_NO_KERNELS is set); callers then take their torch path, which also stays the reference the kernels are
tested against.
"""

from __future__ import annotations

import ctypes

import torch

from engine_core.kernel_build import build
from engine_core.linear_packing import GROUP, weight_format

_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
LINEAR_ARGS = [_P, _I64, _I64, _P, _I, _P, _P, _I64, _I64, _I64]  # csrc/linear.c's linear (bench/kernel_ab.py too)
_SIGNATURES = {
    "paged_decode": [_P] * 6 + [_I] * 6 + [_F, _I64],
    "paged_prefill": [_P, _I64, _P, _P, _P, _I, _P, _I, _P] + [_I] * 4 + [_F, _I64],
    "rms_norm": [_P] * 4 + [_I64, _I, _F],
    "gemma_rms_norm": [_P] * 3 + [_I64, _I, _F],
    "olmo_rms_norm": [_P] * 3 + [_I64, _I, _F],
    "silu_and_mul": [_P, _P, _I64, _I],
    "gelu_tanh_and_mul": [_P, _P, _I64, _I],
    "rotary": [_P] * 4 + [_I64, _I64, _I, _I, _I],
    "argmax_rows": [_P, _I64, _I64, _P],
    "sample_rows": [_P, _I64, _I64] + [_P] * 6,
}


class CpuKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        limits = [ctypes.c_int() for _ in range(4)]
        lib.paged_decode_limits(*map(ctypes.byref, limits))
        self.max_group, self.max_dim, self.max_block, self.max_heads = (x.value for x in limits)
        self.max_hidden = lib.layers_max_hidden()
        self.has_prefill = bool(lib.paged_prefill_available())
        lib.paged_prefill_limits(*map(ctypes.byref, limits))
        self.prefill_limits = tuple(x.value for x in limits)  # group, head_dim, block_size, heads * head_dim
        self._funcs = {}
        for name, argtypes in _SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                func = getattr(lib, f"{name}_{suffix}")
                func.argtypes = argtypes
                self._funcs[name, dtype] = func
        # bf16, int8 and int4 panels with AVX512-BF16, or with AVX2 + FMA (csrc/linear_avx2.c, linear_quant_avx2.c).
        self.has_linear, self.panel_cols = bool(lib.linear_kernels_available()), lib.linear_panel_cols()
        self.has_int8_linear = bool(lib.linear_int8_available())
        self.has_int4_linear = bool(lib.linear_int4_available())
        # int8 and int4 panels summed exactly as the bf16 weights they widen to (engine_core/models/grid_weights.py),
        # read by calls of up to grid_rows rows
        self.has_grid_linear, self.grid_rows = bool(lib.linear_grid_available()), lib.linear_grid_rows()
        self.has_f32_linear = bool(lib.linear_f32_available())  # fp32 panels, AVX-512 or AVX2 (csrc/linear_f32.c)
        # decode attention over an fp8 (e4m3) KV cache (csrc/kv_fp8.c): AVX512-BF16, or AVX2 + FMA + F16C
        self._decode_fp8_takes = lib.decode_fp8_takes
        self._decode_fp8_takes.argtypes = [_I, _I]
        self.has_fp8_decode = bool(self._decode_fp8_takes(64, 16))  # for heads of 64 in blocks of 16, at least
        self._decode_fp8 = lib.paged_decode_fp8
        self._decode_fp8.argtypes = [_P] * 6 + [_I] * 6 + [_F, _I64]
        self._fp8_from_bf16 = lib.fp8_from_bf16
        self._fp8_from_bf16.argtypes = [_P, _P, _I64]
        self.has_amx_linear = bool(lib.linear_amx_available())  # every format on AMX where k % 32 == 0 (linear_amx.c)
        self._linear = lib.linear
        self._linear.argtypes = LINEAR_ARGS
        self._widen = lib.linear_widen
        self._widen.argtypes = [_P, _I, _I64, _I64, _P]
        self._glu_amx = lib.glu_amx
        self._glu_amx.argtypes = [_P, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _I]
        self._linear_f32 = lib.linear_f32
        self._linear_f32.argtypes = [_P, _I64, _I64, _P, _P, _P, _I64, _I64, _I64]
        self._moe_experts = lib.moe_experts_bf16
        self._moe_experts.argtypes = [_P, _I64, _P, _P, _I64, _P, _P, _I, _I64, _P, _P]

    @staticmethod
    def handles(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in _SUFFIX

    # ---- attention ----

    def supports_decode(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        fp8 = k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16
        return (
            self.handles(q)
            and (k_cache.dtype == q.dtype or (fp8 and bool(self._decode_fp8_takes(head_dim, block_size))))
            and q.shape[1] // num_kv_heads <= self.max_group
            and q.shape[1] <= self.max_heads
            and head_dim <= self.max_dim
            and block_size <= self.max_block
        )

    def paged_decode(self, q, k_cache, v_cache, block_tables, seq_lens, scale: float,
                     window: int | None = None) -> torch.Tensor:  # fmt: skip
        """q: [S, Hq, D] (one token per sequence); caches [blocks, block_size, Hk, D]; int64 tables/lens. With a
        sliding window each sequence attends its last `window` keys."""
        q, block_tables, seq_lens = q.contiguous(), block_tables.contiguous(), seq_lens.contiguous()
        out = torch.empty_like(q)
        num_seqs, num_q_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        if k_cache.dtype == torch.float8_e4m3fn:  # widened as it is read (csrc/kv_fp8.c)
            done = self._decode_fp8(
                q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
                out.data_ptr(), num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
                scale, window or 0,
            )  # fmt: skip
            assert done, "an fp8 KV cache this build's kernels do not take (supports_decode)"
            return out
        self._funcs["paged_decode", q.dtype](
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
            out.data_ptr(), num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1], scale,
            window or 0,
        )  # fmt: skip
        return out

    def fp8_from_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """x as float8 e4m3, as the decode stack writes its K/V rows (csrc/kv_fp8.c): the tests hold it equal to
        torch's conversion after the clamp the torch path applies."""
        x = x.contiguous()
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        self._fp8_from_bf16(x.data_ptr(), out.data_ptr(), x.numel())
        return out

    def supports_prefill(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        max_group, max_dim, max_block, max_head_elems = self.prefill_limits
        return (
            self.has_prefill
            and self.handles(q)
            and k_cache.dtype == q.dtype
            and head_dim % 16 == 0
            and q.stride(2) == 1
            and q.stride(1) == head_dim
            and q.shape[1] // num_kv_heads <= max_group
            and head_dim <= max_dim
            and block_size <= max_block
            and q.shape[1] * head_dim <= max_head_elems
        )

    def paged_prefill(self, q, k_cache, v_cache, chunks, block_tables, out, scale: float,
                      window: int | None = None) -> None:  # fmt: skip
        """Writes out[rows of each chunk]. q: [T, Hq, D] (rows may be strided); chunks: int64 [C, 3] of
        (first row, query rows, context length after the chunk); block_tables: int64 [C, max_blocks]. With a
        sliding window each row attends its last `window` keys."""
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        self._funcs["paged_prefill", q.dtype](
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), chunks.data_ptr(), chunks.shape[0],
            block_tables.data_ptr(), block_tables.shape[1], out.data_ptr(), q.shape[1], num_kv_heads, head_dim,
            block_size, scale, window or 0,
        )  # fmt: skip

    # ---- elementwise layers (contiguous 2-D inputs) ----

    def supports_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
        if residual is not None and not (residual.is_contiguous() and residual.shape == x.shape):
            return False
        same_dtype = weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
        return same_dtype and x.shape[1] <= self.max_hidden

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
        """Without residual: norm(x) * weight. With it: residual += x in place, then norm(residual) * weight."""
        out = torch.empty_like(x)
        res_ptr = None if residual is None else residual.data_ptr()
        self._funcs["rms_norm", x.dtype](x.data_ptr(), res_ptr, weight.data_ptr(), out.data_ptr(), x.shape[0],
                                         x.shape[1], eps)  # fmt: skip
        return out

    def scaled_rms_norm(self, kind: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """In fp32, rounded once: Gemma's norm(x) * (1 + weight) (kind "gemma"), OLMo 2's norm(x) * weight ("olmo")."""
        out = torch.empty_like(x)
        self._funcs[f"{kind}_rms_norm", x.dtype](x.data_ptr(), weight.data_ptr(), out.data_ptr(), *x.shape, eps)
        return out

    def act_and_mul(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """x [T, 2 * width] holding gate then up: act(gate) * up; act: "silu" or "gelu_tanh"."""
        width = x.shape[1] // 2
        out = torch.empty((x.shape[0], width), dtype=x.dtype)
        self._funcs[f"{act}_and_mul", x.dtype](x.data_ptr(), out.data_ptr(), x.shape[0], width)
        return out

    def rotary_(self, x: torch.Tensor, num_heads: int, head_dim: int, positions, cos, sin) -> None:
        """Rotates the first num_heads heads of every row of x [T, >= num_heads * head_dim] in place, each on its
        first cos.shape[1] dims (all of them, or fewer for a partial rotary); positions int64 [T]; cos/sin fp32
        [max_positions, rotary dims]."""
        self._funcs["rotary", x.dtype](x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                       x.shape[0], x.stride(0), num_heads, head_dim, cos.shape[1])  # fmt: skip

    # ---- linears (csrc/linear*.c): bf16, fp32, weight-only int8 and int4; packed by linear_packing ----

    def supports_linear(self, dtype: torch.dtype, in_features: int) -> bool:
        """Whether our kernel runs a plain linear of this dtype (bf16 packs k in pairs: in_features even)."""
        if dtype == torch.float32:
            return self.has_f32_linear
        return dtype == torch.bfloat16 and self.has_linear and in_features % 2 == 0

    def supports_quantized_linear(self, method: str, in_features: int) -> bool:
        """method: "int8" or "int4"; both quantize groups of GROUP weights."""
        return (self.has_int8_linear if method == "int8" else self.has_int4_linear) and in_features % GROUP == 0

    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:  # 2-D rows for the linears: strided rows, contiguous elements
        rows = x.reshape(-1, x.shape[-1])
        return rows if rows.stride(1) == 1 else rows.contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int):
        """x: [..., K], fp32 for fp32 panels, else bf16; packed: from linear_packing (its dtype names the format);
        bias: [N] in x's dtype, or None. Rows of a 2-D x may be strided (a slice of a wider activation)."""
        rows = self._rows(x)
        out = torch.empty((rows.shape[0], out_features), dtype=x.dtype)
        bias_ptr = None if bias is None else bias.data_ptr()
        if packed.dtype == torch.float32:
            self._linear_f32(rows.data_ptr(), rows.stride(0), rows.shape[0], packed.data_ptr(), bias_ptr,
                             out.data_ptr(), out_features, out_features, rows.shape[1])  # fmt: skip
        else:
            self._linear(rows.data_ptr(), rows.stride(0), rows.shape[0], packed.data_ptr(), weight_format(packed),
                         bias_ptr, out.data_ptr(), out_features, out_features, rows.shape[1])  # fmt: skip
        return out.view(*x.shape[:-1], out_features)

    def widen(self, packed: torch.Tensor, rows: int, in_features: int) -> torch.Tensor:
        """The bf16 weight [rows, in_features] that int8 or int16-tagged int4 panels stand for, as linear() widens
        them (has_grid_linear only)."""
        out = torch.empty((rows, in_features), dtype=torch.bfloat16)
        self._widen(packed.data_ptr(), weight_format(packed), rows, in_features, out.data_ptr())
        return out

    def linear_glu(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, half: int, act: str):
        """act(gate) * up of a merged gate_up linear (gate its first `half` outputs) in one AMX call (csrc/glu_amx.c),
        bit for bit linear() then act_and_mul(); None where it does not run (no AMX, not bf16, k % 32, half % 16)."""
        if not self.has_amx_linear or weight_format(packed) != 0:
            return None
        rows = self._rows(x)
        out, bias_ptr = torch.empty((rows.shape[0], half), dtype=x.dtype), None if bias is None else bias.data_ptr()
        ran = self._glu_amx(rows.data_ptr(), rows.stride(0), rows.shape[0], packed.data_ptr(), bias_ptr, out.data_ptr(),
                            half, half, rows.shape[1], act == "gelu_tanh")  # fmt: skip
        return out.view(*x.shape[:-1], half) if ran else None

    def moe_experts(self, x: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, gate_up, down, fmt: int,
                    intermediate: int, work: torch.Tensor, out: torch.Tensor) -> None:  # fmt: skip
        """A mixture of experts' layer (csrc/moe.c): out[i] = expert(x[slots[i]]) for the slots grouped by expert
        (counts: int64 [experts]); gate_up, down: ctypes arrays of each expert's packed weights."""
        self._moe_experts(x.data_ptr(), x.shape[1], slots.data_ptr(), counts.data_ptr(), len(counts), gate_up, down,
                          fmt, intermediate, work.data_ptr(), out.data_ptr())  # fmt: skip

    # ---- sampling ----

    def sample_rows(self, x: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """One token per row of contiguous logits [rows, vocab] drawn from softmax(x / T) after min-p, top-k (0:
        off) and top-p, at the fp32 uniform number in [0, 1) given for the row (inverse CDF, the kept tokens in
        descending order where top-k or top-p is on); T <= 0: the row's first maximum. -inf logits are never drawn."""
        out = torch.empty(x.shape[0], dtype=torch.long)
        floats = [t.float().contiguous() for t in (temperatures, top_p, min_p, uniforms)]
        top_k = top_k.long().contiguous()
        self._funcs["sample_rows", x.dtype](x.data_ptr(), x.shape[0], x.shape[1], floats[0].data_ptr(),
                                            top_k.data_ptr(), floats[1].data_ptr(), floats[2].data_ptr(),
                                            floats[3].data_ptr(), out.data_ptr())  # fmt: skip
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of contiguous logits [rows, vocab], in their own dtype; first index on a tie."""
        out = torch.empty(x.shape[0], dtype=torch.long)
        self._funcs["argmax_rows", x.dtype](x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out


_kernels: CpuKernels | None | bool = False  # False: not tried yet


def cpu_kernels() -> CpuKernels | None:
    global _kernels
    if _kernels is False:
        lib = build()
        _kernels = CpuKernels(lib) if lib is not None else None
    return _kernels  # type: ignore[return-value]
