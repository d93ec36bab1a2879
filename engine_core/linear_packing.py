"""Weights laid out for our CPU matmul kernels (csrc/linear.c, csrc/linear_int4.c, csrc/linear_f32.c), once at
load.

Every format cuts the weight [N, K] into panels of up to `cols` output rows (48), the last one's rows rounded up to
16 with zeros. The packed tensor's dtype names its format for the kernel (FORMATS): bf16 panels in vdpbf16ps's
pair layout (for each pair of k, the panel's rows x 2 values), int8 panels (per group of 32 k, the weights then
each lane's scale), int4 panels (per group of 32 k, four pairs' nibbles in each 16-bit lane, then each row's scale
and min; summed either on the int4 grid or, tagged int16 and their lanes in another order, as the bf16 weights they
widen to), or fp32 panels (for each k, the panel's rows).
"""

from __future__ import annotations

import torch

# The kernels' `format` argument (csrc/linear.c's linear; 3 is csrc/linear_f32.c's) for each packed dtype. int16
# tags int4 panels the kernels widen to bf16 and sum as bf16 (pack_int4_as_bf16).
FORMATS = {torch.bfloat16: 0, torch.int8: 1, torch.uint8: 2, torch.float32: 3, torch.int16: 4}
GROUP = 32  # int8 and int4: k per scale (and min), the kernels' unit


def weight_format(packed: torch.Tensor) -> int:
    return FORMATS[packed.dtype]


def _panels(rows: int, cols: int) -> list[tuple[int, int]]:
    """(first row, row count) of each panel of a weight with `rows` rows rounded up to 16."""
    padded = -(-rows // 16) * 16
    return [(n0, min(cols, padded - n0)) for n0 in range(0, padded, cols)]


def _rows_to_16(t: torch.Tensor) -> torch.Tensor:
    """t with zero rows appended up to a multiple of 16 (the kernel's vector of output columns)."""
    return torch.cat([t, t.new_zeros((-len(t) % 16, *t.shape[1:]))])


def _k_major_panels(units: torch.Tensor, cols: int) -> torch.Tensor:
    """[N, U] -> panels of `cols` rows (the last rounded up to 16 with zeros), each laid out unit-major: for each
    of the U units, the panel's rows' values side by side."""
    if len(units) % 16:
        units = _rows_to_16(units)
    # Transposed straight into the result, the whole panels in one copy: packing the default model at each start
    # took 0.93 s a pair and a panel at a time; 128 experts' 5 GB took 13 s with a copy before and after this one,
    # half that without.
    n, u = units.shape
    whole = n // cols * cols
    out = units.new_empty(n * u)
    out[: whole * u].view(-1, u, cols).copy_(units[:whole].view(-1, cols, u).transpose(1, 2))
    out[whole * u :].view(u, n - whole).copy_(units[whole:].T)
    return out


def pack_bf16(weight: torch.Tensor, cols: int) -> torch.Tensor:
    """[N, K] bf16 (K even) -> bf16 panels: a k pair (one int32) is the unit."""
    pairs = weight.to(torch.bfloat16).contiguous().view(torch.int32)
    return _k_major_panels(pairs, cols).view(torch.bfloat16)


def pack_f32(weight: torch.Tensor, cols: int) -> torch.Tensor:
    """[N, K] -> fp32 panels, k-major (csrc/linear_f32.c)."""
    return _k_major_panels(weight.to(torch.float32).contiguous(), cols)


def pack_int8(q: torch.Tensor, scale: torch.Tensor, cols: int) -> torch.Tensor:
    """int8 [N, K] and fp32 scales [N, K / 32] (grid_fit.quantize_int8) -> int8 panels: per group of 32 k, the int8
    weights as pack_bf16 lays them out, then each vector lane's scale (a row's scale twice, for the two k of its
    pair)."""
    n, k = q.shape
    groups = k // GROUP
    q_pad, s_pad = _rows_to_16(q), _rows_to_16(scale.float())
    parts = []
    for n0, c in _panels(n, cols):
        weights = q_pad[n0 : n0 + c].view(c, groups, 16, 2).permute(1, 2, 0, 3).reshape(groups, -1)
        scales = s_pad[n0 : n0 + c].T.repeat_interleave(2, dim=1).contiguous().view(torch.int8)
        parts.append(torch.cat([weights, scales], dim=1).flatten())
    return torch.cat(parts)


def _int4_panels(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, cols: int, grid: bool) -> torch.Tensor:
    """pack_int4's panels, or with grid=True pack_int4_as_bf16's (the same but for the order of each load's lanes)."""
    n, k = q.shape
    groups = k // GROUP
    q_pad, s_pad, m_pad = _rows_to_16(q), _rows_to_16(scale.float()), _rows_to_16(mins.float())
    # k = 32 group + 8 t + 2 r + kk, pair 4t + r in bits 4r of its 16-bit lane; row = 16 vector + 8 half + column.
    # int4: lane = 2 (8 half + column) + kk, the pair layout; format 4: lane = 4 column + 2 kk + half.
    lane_order = (2, 6, 1) if grid else (1, 2, 6)
    parts = []
    for n0, c in _panels(n, cols):
        lanes = q_pad[n0 : n0 + c].view(c // 16, 2, 8, groups, 4, 4, 2).permute(3, 4, 0, *lane_order, 5)
        lanes = lanes.to(torch.int32)
        four = lanes[..., 0] | lanes[..., 1] << 4 | lanes[..., 2] << 8 | lanes[..., 3] << 12
        nibbles = four.to(torch.uint16).contiguous().view(torch.uint8).reshape(groups, -1)
        scales = s_pad[n0 : n0 + c].T.contiguous().view(torch.uint8)
        mins_ = m_pad[n0 : n0 + c].T.contiguous().view(torch.uint8)
        parts.append(torch.cat([nibbles, scales, mins_], dim=1).flatten())
    return torch.cat(parts)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, cols: int) -> torch.Tensor:
    """q in 0..15 (uint8 [N, K]), fp32 scales and mins [N, K / 32] (grid_fit.quantize_int4) -> uint8 panels: per
    group of 32 k, for each four k pairs and vector of 16 rows, 32 16-bit lanes, lane l holding lane l of the four
    pairs' layouts in its nibbles (the first pair's lowest); then the panel's scales, then its mins."""
    return _int4_panels(q, scale, mins, cols, grid=False)


def pack_int4_as_bf16(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, cols: int) -> torch.Tensor:
    """Panels (tagged int16) that the kernels widen to bf16(scale * q + min) and sum as bf16 weights (format 4,
    engine_core/models/grid_weights.py): pack_int4's, but for each four k pairs and vector, lane 4c + 2kk + h holds
    row 8h + c's k 2p + kk of the pairs p, the order in which kernel_common.h's int4_bf16_pairs widens them."""
    return _int4_panels(q, scale, mins, cols, grid=True).view(torch.int16)
