"""Checkpoints quantized to 4 bits before they were saved (common/checkpoint_quant.py: GPTQ, AWQ, compressed-tensors)
on our int4 grid, without loss: each stores a weight as w = scale * (q - zero) with q and zero in 0..15 and one
scale and zero per group of input features, which is our int4's w = scale * q + min (engine_core/models/quant.py)
with min = -scale * zero (exact in fp32) for each of the group's runs of 32. The weights are never widened to
floats: a quantized linear is an Int4Weights until the checkpoint is read, then a QuantizedLinear.

Layouts (int32 words of eight 4-bit values, the lowest bits first; K input features, N outputs):
- GPTQ: qweight [K / 8, N] packs along the input features; qzeros [groups, N / 8] along the outputs, holding
  zero - 1 in the original format; g_idx [K] names each input feature's group.
- AWQ (GEMM): qweight [K, N / 8] and qzeros [groups, N / 8] pack along the outputs, the eight columns of a word in
  the order 0 2 4 6 1 3 5 7.
- compressed-tensors (pack-quantized): weight_packed [N, K / 8] packs along the input features, each value its
  signed q + 8; weight_zero_point [N / 8, groups] along the outputs, the same way (symmetric: none, every zero 8);
  weight_scale [N, groups]; weight_g_idx [K] where present.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from common.checkpoint_quant import GROUP, QuantScheme
from common.model_errors import ModelSourceError
from engine_core.models.quant import Int4Weights

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_AWQ_COLUMN = [0, 2, 4, 6, 1, 3, 5, 7]  # the column of each nibble (lowest first) within its word of eight
# Per method: the parts a quantized linear needs (its zero points unless symmetric), then those it may have.
_PARTS = {
    "gptq": (("qweight", "scales", "qzeros"), ("g_idx",)),
    "awq": (("qweight", "scales", "qzeros"), ()),
    "compressed-tensors": (("weight_packed", "weight_scale", "weight_zero_point"), ("weight_g_idx", "weight_shape")),
}


def _needed(scheme: QuantScheme) -> tuple[str, ...]:
    needed = _PARTS[scheme.method][0]
    return needed[:2] if scheme.symmetric else needed


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, C, 8]: each word's eight values, the lowest bits first."""
    return ((words.unsqueeze(-1) >> _SHIFTS) & 15).to(torch.uint8)


def _columns(words: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """Values packed along the columns ([R, C] words) -> uint8 [R, 8 C], in `order` within each word."""
    values = _nibbles(words)
    if order is not None:
        values = torch.empty_like(values).index_copy_(2, torch.tensor(order), values)
    return values.reshape(words.shape[0], -1)


def _as_k_by_n(parts: dict[str, torch.Tensor], scheme: QuantScheme) -> tuple[torch.Tensor, ...]:
    """Any layout -> q [K, N], zeros and scales [groups, N], g_idx [K] or None."""
    if scheme.method == "gptq":
        words = parts["qweight"]
        q = _nibbles(words).permute(0, 2, 1).reshape(-1, words.shape[1])
        return q, _columns(parts["qzeros"]), parts["scales"], parts.get("g_idx")
    if scheme.method == "awq":
        return _columns(parts["qweight"], _AWQ_COLUMN), _columns(parts["qzeros"], _AWQ_COLUMN), parts["scales"], None
    q = _columns(parts["weight_packed"]).T
    scales = parts["weight_scale"].T
    zeros = torch.full_like(scales, 8) if scheme.symmetric else _columns(parts["weight_zero_point"].T)
    return q, zeros, scales, parts.get("weight_g_idx")


def unpack(parts: dict[str, torch.Tensor], scheme: QuantScheme) -> tuple[torch.Tensor, ...]:
    """One linear's checkpoint tensors -> ours: q (uint8 [N, K] in 0..15), fp32 scales and mins [N, K / 32]."""
    q, zeros, scales, g_idx = _as_k_by_n(parts, scheme)
    k, n = q.shape
    if k % GROUP:
        raise ModelSourceError(f"{k} input features: a multiple of {GROUP} is needed to serve 4-bit weights")
    # Each run of 32 input features must lie in one group (a g_idx names the group of each feature).
    group_of = g_idx.long() if g_idx is not None else _groups_in_order(k, scheme)
    runs = group_of.view(-1, GROUP)
    if not bool((runs == runs[:, :1]).all()) or int(runs.max()) >= scales.shape[0]:
        raise ModelSourceError("g_idx puts input features of one run of 32 in different groups (desc_act?): only "
                               "groups of consecutive features are supported")
    group = runs[:, 0]
    scale = scales.float()[group].T.contiguous()  # [N, K / 32]
    zero = (zeros[:, :n].float() + scheme.zero_offset)[group].T
    return q.T.contiguous(), scale, (-scale * zero).contiguous()


def quantized_prefixes(path: Path) -> set[str]:
    """The checkpoint's names of its quantized linears ("model.layers.0.self_attn.q_proj", ...)."""
    prefixes = set()
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            prefixes |= {key.rpartition(".")[0] for key in f.keys() if key.endswith((".qweight", ".weight_packed"))}  # noqa: SIM118
    return prefixes


def take_quantized_linears(model: nn.Module, prefixes: set[str], target) -> int:
    """Replaces the model's linears that the checkpoint stores quantized by Int4Weights, before the checkpoint is
    read: their float weights are never filled. `target(name)`: the loader's (module, shard) for a checkpoint
    weight's name, or None for one the model does not use."""
    if hasattr(model, "convert_weight"):
        raise ModelSourceError(f"4-bit checkpoints of {type(model).__name__} are not supported")
    names = set()
    for prefix in prefixes:
        found = target(prefix + ".weight")
        if found is None:
            continue
        module_name = found[0]
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            module = None
        if not isinstance(module, nn.Linear | Int4Weights):
            raise ModelSourceError(f"{prefix}: a quantized weight where {type(model).__name__} has no linear layer")
        names.add(module_name)
    for name in sorted(names):
        parent, _, attr = name.rpartition(".")
        holder = model.get_submodule(parent)
        linear = getattr(holder, attr)
        if isinstance(linear, nn.Linear):
            setattr(holder, attr, Int4Weights(linear))
    return len(names)


def unpack_checkpoint(tensors: Iterable[tuple[str, torch.Tensor]], scheme: QuantScheme
                      ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """The checkpoint's tensors with each quantized linear's parts, once all it needs have come, as ours:
    `weight_q`, `weight_scale` and `weight_min` under its name. Others pass as they are. A part it may have (a
    g_idx) comes first where present (a file's keys are sorted); one that comes after its linear is checked
    alone."""
    needed, optional = _needed(scheme), _PARTS[scheme.method][1]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    for key, tensor in tensors:
        prefix, _, part = key.rpartition(".")
        if part in optional and prefix in done:
            if part.endswith("g_idx"):
                check_late_g_idx(tensor, scheme)
            continue
        if part not in needed and part not in optional:
            yield key, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if all(p in parts for p in needed):
            del pending[prefix]
            done.add(prefix)
            q, scale, mins = unpack(parts, scheme)
            yield from ((f"{prefix}.weight_q", q), (f"{prefix}.weight_scale", scale), (f"{prefix}.weight_min", mins))
    if pending:
        prefix, parts = next(iter(pending.items()))
        raise ModelSourceError(f"{prefix}: the checkpoint has {sorted(parts)} of a quantized linear's {list(needed)}")


def _groups_in_order(k: int, scheme: QuantScheme) -> torch.Tensor:
    """Each of k input features' group where the groups are consecutive features (no g_idx, or a trivial one)."""
    return torch.arange(k) // (k if scheme.group_size == -1 else scheme.group_size)


def check_late_g_idx(g_idx: torch.Tensor, scheme: QuantScheme) -> None:
    if not torch.equal(g_idx.long(), _groups_in_order(len(g_idx), scheme)):
        raise ModelSourceError("g_idx is not in the order of the input features (desc_act?): only groups of "
                               "consecutive features are supported")


def shard_part(model: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Tensor parallel: this rank's slice of a quantized linear's part, as model.shard_weight slices its weight
    (rows, or columns: input features, of which a scale or min covers 32). Every rank's share of the input features
    is whole runs of 32 (Int4Weights checks its own), so the runs stay whole."""
    base, _, part = name.rpartition(".")
    if part not in ("weight_scale", "weight_min"):
        return model.shard_weight(f"{base}.weight" if part == "weight_q" else name, tensor)
    wide = model.shard_weight(f"{base}.weight", tensor.repeat_interleave(GROUP, dim=1))
    runs = wide.view(wide.shape[0], -1, GROUP)
    if not bool((runs == runs[..., :1]).all()):
        raise ModelSourceError(f"{base}: this rank's share of the input features does not start on a run of {GROUP}")
    return runs[..., 0].contiguous()
