"""Fitting a weight to our int8 and int4 grids (groups of 32 k of a row, as GGUF's Q8_0 and Q4_1), and back:
--quantization's int8 and int4 (engine_core/models/quant.py) and the grids a checkpoint's weights already lie on
(engine_core/models/grid_weights.py, which also fits Q4_0's groups with quantize_q4_0, and Q4_K's with
quantize_int4's shorter ranges)."""

from __future__ import annotations

import torch

from engine_core.linear_packing import GROUP

_ROWS_PER_PASS = 4096  # rows quantized at a time (see _row_slices)


def _group_size(k: int) -> int:
    """GROUP, or the whole row when K is not a multiple of it (then only torch's path runs it)."""
    return GROUP if k % GROUP == 0 else k


def _row_slices(weight: torch.Tensor):
    """The weight's rows a slice at a time (a big one, the LM head, is never copied to fp32 whole): each slice's
    rows, and them in fp32 as [rows, K / g, g]."""
    n, k = weight.shape
    for start in range(0, n, _ROWS_PER_PASS):
        at = slice(start, start + _ROWS_PER_PASS)
        yield at, weight[at].float().view(-1, k // _group_size(k), _group_size(k))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], fp32 scales [N, K / g]) with weight ~= q * scale of its group, |q| <= 127."""
    n, k = weight.shape
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty((n, k // _group_size(k)), dtype=torch.float32, device=weight.device)
    for at, rows in _row_slices(weight):
        s = rows.abs().amax(dim=2).clamp(min=1e-12) / 127  # an all-zero group keeps q = 0
        q[at] = torch.round(rows / s[..., None]).clamp(-127, 127).to(torch.int8).view(-1, k)
        scale[at] = s
    return q, scale


def quantize_int4(
    weight: torch.Tensor, steps: int | torch.Tensor = 15
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q: uint8 [N, K] in 0..15, fp32 scales and mins [N, K / g]) with weight ~= scale * q + min
    of its group: min the group's least weight, scale its range / `steps` (15, the whole grid; fewer, or one count
    per group [N, K / g], where a checkpoint's quantizer left a group's q short of it, as the K formats' do)."""
    n, k = weight.shape
    q = torch.empty(weight.shape, dtype=torch.uint8, device=weight.device)
    scale = torch.empty((n, k // _group_size(k)), dtype=torch.float32, device=weight.device)
    mins = torch.empty_like(scale)
    for at, rows in _row_slices(weight):
        low = rows.amin(dim=2)
        span = steps if isinstance(steps, int) else steps[at]
        s = (rows.amax(dim=2) - low).clamp(min=1e-12) / span  # a constant group keeps q = 0: w = min
        q[at] = torch.round((rows - low[..., None]) / s[..., None]).clamp(0, 15).to(torch.uint8).view(-1, k)
        scale[at], mins[at] = s, low
    return q, scale, mins


def steps_by_gaps(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> [N, K / 32]: how many steps of its smallest gap between distinct values each group's range
    spans (1 to 15), the grid's steps where the group uses two neighbouring levels anywhere."""
    groups = weight.float().unflatten(1, (-1, GROUP)).sort(dim=2).values
    gaps = groups.diff(dim=2)
    smallest = torch.where(gaps > 0, gaps, torch.inf).amin(dim=2)
    span = groups[..., -1] - groups[..., 0]
    return torch.where(smallest.isfinite(), torch.round(span / smallest), 1).clamp(1, 15)


def quantize_q4_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q, scale, min) as quantize_int4 gives them, fitted as Q4_0 is made: w = d (q - 8), where
    llama.cpp's quantizer gives a group's weight of largest magnitude q = 0, so min = that weight and scale =
    -min / 8 (negative where it is positive)."""
    groups = weight.float().unflatten(1, (-1, GROUP))
    mins = groups.gather(2, groups.abs().argmax(dim=2, keepdim=True)).squeeze(2)
    scale = torch.where(mins == 0, torch.full_like(mins, 1e-12), -mins / 8)  # an all-zero group keeps q = 0
    q = torch.round((groups - mins[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).flatten(1)
    return q, scale, mins


def dequantize(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weight that (q, scale) stand for (int8), or (q, scale, mins) (int4)."""
    w = q.float().view(q.shape[0], scale.shape[1], -1) * scale[..., None]
    return (w if mins is None else w + mins[..., None]).view(q.shape)
