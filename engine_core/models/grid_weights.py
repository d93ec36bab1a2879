"""Linear weights a checkpoint holds on a 4- or 8-bit grid, kept on it too when served in bf16 on CPU.

A GGUF's 4- and 8-bit layers reach the engine dequantized (common/gguf_convert.py writes float32), and bf16 panels
read them at 2 bytes a weight where the file's grid needs 0.75 (int4 panels: the nibbles, an fp32 scale and min per
32) or 1.25 (int8). A decode step of few rows waits for those bytes. So where a linear's weight, rounded to bf16,
equals bit for bit what our kernels widen from a grid (int4: bf16(fma(q, scale, min)), format 4; int8: bf16(q *
scale), format 1), the linear keeps the grid's panels beside its bf16 ones, and calls of few rows read them
(PackedLinear._panels, the decode stack's weight_linear): the kernels sum the very bf16 weights, so the bits are
the same, from a third of the bytes. The grid is fitted as --quantization fits it, which finds Q4_1 and Q8_0 groups
(the default model's) exactly, or else as Q4_0's quantizer made it, or over fewer steps than 15 (Q4_K's groups); a
weight with a group that no fit gives back (Q6_K's, whose scales cover 16 weights) stays bf16 only. Each
weight is checked whole as the loader reads it (float32, before it is rounded). ROSEINFER_GRID_WEIGHTS=0 keeps no
grid (to compare them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from common.gguf_weights import matching_quantization
from engine_core.cpu_kernels import CpuKernels, cpu_kernels
from engine_core.linear_packing import GROUP, pack_int4_as_bf16, pack_int8
from engine_core.models.grid_fit import quantize_int4, quantize_int8, quantize_q4_0, steps_by_gaps

Parts = tuple[torch.Tensor, ...]  # int4: (q, scale, min); int8: (q, scale), as grid_fit.quantize_int4/8 make them
_ROWS = 4080  # rows checked at a time (85 panels), after the first _PROBE_ROWS: a weight off the grid is given up on
_PROBE_ROWS = 96  # there (a Q6_K ffn_down of a 1B Llama had taken 4.7 s to fail on its first 4080 rows)


def grids_wanted(model_dir: Path, dtype: torch.dtype, device: torch.device, quantization: str) -> bool:
    """Whether to look for grids while loading: bf16 on a CPU whose kernels sum grids as bf16 (AVX512-BF16), no
    --quantization of its own, and a model converted from a GGUF whose layers were mostly stored in 4 or 8 bits (a
    float32 checkpoint of any other origin is not worth the look)."""
    if os.environ.get("ROSEINFER_GRID_WEIGHTS", "1") == "0" or quantization != "none":
        return False
    if device.type != "cpu" or dtype != torch.bfloat16 or matching_quantization(model_dir) is None:
        return False
    kernels = cpu_kernels()
    return kernels is not None and kernels.has_grid_linear


# int4's fits after --quantization's own (a group's least weight, its range / 15: Q4_1's groups), for the groups it
# misses: as Q4_0's quantizer made them, and over as many steps as the group's smallest gap between values spans
# (Q4_K's groups, whose quantizer leaves q short of 15: their scale d x sc and min dmin x m are exact in fp32, so the
# range over the q actually used gives them back; every Q4_K weight of a 1B Llama fitted). Where both take a
# weight's groups, Q4_0's, the cheaper, goes first.
_INT4_REFITS = [quantize_q4_0, lambda rows: quantize_int4(rows, steps_by_gaps(rows))]


def _on_grid(weight: torch.Tensor, method: str, kernels: CpuKernels) -> Parts | None:
    """The weight's parts on `method`'s grid, if the kernel widens every one back to the weight's own bf16. The
    kernel's widening is the check (kernels.widen), so that no rounding of it (one fma, subnormals flushed) has to
    be imitated here. int8 is fitted as --quantization fits it (a group's largest magnitude / 127); int4 so too, and
    a group that misses that way by _INT4_REFITS in turn, the one that alone takes most of the first slice's misses
    first (one quantizer made the whole weight: a Q4_K weight's every slice had first paid for the Q4_0 fit)."""
    pack = pack_int4_as_bf16 if method == "int4" else pack_int8
    refits = list(_INT4_REFITS) if method == "int4" else []
    slices = []
    for start, end in _slices(len(weight)):
        rows = weight[start:end]
        parts = quantize_int4(rows) if method == "int4" else quantize_int8(rows)
        missed = _missed_groups(kernels.widen(pack(*parts, kernels.panel_cols), *rows.shape), rows)
        if start == 0 and missed.any():
            refits.sort(key=lambda refit: int(_refitted(refit, rows, parts, missed, kernels)[1].sum()))
        for refit in refits:
            if not missed.any():
                break
            parts, missed = _refitted(refit, rows, parts, missed, kernels)
        if missed.any():
            return None
        slices.append(parts)
    return tuple(torch.cat(column) for column in zip(*slices, strict=True))


def _refitted(refit: Callable[[torch.Tensor], Parts], rows: torch.Tensor, parts: Parts, missed: torch.Tensor,
              kernels: CpuKernels) -> tuple[Parts, torch.Tensor]:  # fmt: skip
    """int4 parts with `refit`'s q, scale and min in the missed groups it gives back, and the groups still missed;
    only the rows with a miss are fitted and checked again (all of them, as after a Q4_0 weight's first fit, as
    views: no copies)."""
    with_miss = missed.any(dim=1)
    at = slice(None) if with_miss.all() else with_miss.nonzero().squeeze(1)
    some, some_rows, some_missed = tuple(p[at] for p in parts), rows[at], missed[at]
    tried = _merged(some, refit(some_rows), some_missed)
    still = _missed_groups(kernels.widen(pack_int4_as_bf16(*tried, kernels.panel_cols), *some_rows.shape), some_rows)
    kept = _merged(some, tried, some_missed & ~still)
    if isinstance(at, slice):
        return kept, some_missed & still
    whole, left = tuple(p.clone() for p in parts), missed.clone()
    for p, k in zip(whole, kept, strict=True):
        p[at] = k
    left[at] = some_missed & still
    return whole, left


def _slices(rows: int) -> list[tuple[int, int]]:
    """(start, end) of the slices a weight of `rows` rows is checked in: _PROBE_ROWS, then _ROWS at a time."""
    starts = [0, *range(_PROBE_ROWS, rows, _ROWS)]
    return list(zip(starts, [*starts[1:], rows], strict=True))


def _merged(parts: Parts, other: Parts, groups: torch.Tensor) -> Parts:
    """int4 parts taking `other`'s q, scale and min in the groups [N, K / 32] marked True."""
    q, scale, mins = parts
    q = torch.where(groups.repeat_interleave(GROUP, dim=1), other[0], q)
    return q, torch.where(groups, other[1], scale), torch.where(groups, other[2], mins)


def _missed_groups(widened: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[N, K / 32] True where a group's widened weights are not the weight's bf16."""
    return (widened != rows.bfloat16()).unflatten(1, (-1, GROUP)).any(dim=2)


def find_grid(weight: torch.Tensor) -> tuple[str, Parts] | None:
    """("int4" or "int8", its parts) of the first grid a float32 weight [N, K] lies on, or None."""
    kernels = cpu_kernels()
    if kernels is None or not kernels.has_grid_linear:
        return None
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % GROUP:
        return None
    for method in ("int4", "int8"):
        parts = _on_grid(weight, method, kernels)
        if parts is not None:
            return method, parts
    return None


class GridWeights:
    """The grid panels of each linear weight the loader found on a grid (whole, or every part of a fused layer on
    the same one), packed as soon as the weight is complete, so that loading holds no more than they will; keyed by
    the parameter (a tied LM head shares its embedding's)."""

    def __init__(self, model: nn.Module) -> None:
        self._parts_of = {id(m.weight): len(getattr(m, "shard_sizes", None) or [0])
                          for m in model.modules() if isinstance(m, nn.Linear)}  # fmt: skip
        self._found: dict[int, dict[int, tuple[str, Parts] | None]] = {}  # a fused weight's parts so far
        self._panels: dict[int, torch.Tensor | None] = {}

    def offer(self, param: torch.Tensor, shard: int | None, tensor: torch.Tensor) -> None:
        """The checkpoint's tensor for `param` (or for its fused part `shard`), before it is rounded into it."""
        parts = self._parts_of.get(id(param))
        if parts is None:
            return
        found = self._found.setdefault(id(param), {})
        found[shard or 0] = find_grid(tensor)
        if len(found) == parts:
            self._panels[id(param)] = _packed(found, parts)
            del self._found[id(param)]

    def take(self, linear: nn.Linear) -> torch.Tensor | None:
        """The grid panels of the linear's weight: pack_int4_as_bf16's or pack_int8's; None where any part missed a
        grid, or the parts' grids differ, or not all of them were seen."""
        return self._panels.pop(id(linear.weight), None)


def _packed(found: dict[int, tuple[str, Parts] | None], parts: int) -> torch.Tensor | None:
    """The panels of a weight's parts (rows in part order), where all of them lie on one grid."""
    if sorted(found) != list(range(parts)) or None in found.values() or len({f[0] for f in found.values()}) != 1:
        return None
    method = found[0][0]
    whole = tuple(torch.cat(column) for column in zip(*(found[i][1] for i in range(parts)), strict=True))
    return (pack_int4_as_bf16 if method == "int4" else pack_int8)(*whole, cpu_kernels().panel_cols)
