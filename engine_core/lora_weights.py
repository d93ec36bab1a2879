"""A PEFT adapter's weights read and checked against our model: each linear layer it changes, as one (A, B) pair per
fused layer (engine_core/lora.py puts them in the model)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from common.lora import LoraModule, weights_file

# PEFT's names: base_model.model.<the checkpoint's module>.lora_A.weight ([rank, in]) and .lora_B.weight ([out, rank])
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
LayerWeights = tuple[str, int, torch.Tensor, torch.Tensor]  # our layer's name, its shard, A, B
WHOLE = -1  # the shard of an adapter that changes all of a layer: an unfused one, or a fused one by its own name


def adapter_weights(
    model: nn.Module, module: LoraModule, packed: dict[str, tuple[str, int]]
) -> Iterator[LayerWeights]:
    """(our layer's name, its shard, A, B) for every linear layer the adapter changes."""
    where = f"LoRA adapter {module.name!r}"
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_weights(module).items():
        match = _KEY.match(key)
        if match is None or not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{where}: {key} is not a LoRA weight of a linear layer (nothing else is supported)")
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    for hf_name, ab in pairs.items():
        name = model.checkpoint_name(hf_name + ".weight")
        head, _, leaf = (name or "").removesuffix(".weight").rpartition(".")
        if name is None or not head.startswith("layers.") or set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: {hf_name} is not a decoder layer's linear with both lora_A and lora_B")
        if any(t.dim() != 2 or 0 in t.shape for t in ab.values()):
            raise ValueError(f"{where}: {hf_name}'s lora_A and lora_B must be matrices of rank at least 1")
        # q_proj is a shard of our qkv_proj; Phi-3's checkpoints, and so its adapters, name qkv_proj itself.
        target, shard = (f"{head}.{packed[leaf][0]}", packed[leaf][1]) if leaf in packed else (f"{head}.{leaf}", WHOLE)
        try:
            model.get_submodule(target)
        except AttributeError:
            raise ValueError(f"{where}: the model has no layer {hf_name}") from None
        yield target, shard, ab["A"], ab["B"]


def _read_weights(module: LoraModule) -> dict[str, torch.Tensor]:
    path = weights_file(Path(module.path))
    if path is None:
        raise ValueError(f"LoRA adapter {module.name!r}: its weights are gone from {module.path}")
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors only: no pickled code runs
    except Exception as exc:
        raise ValueError(f"LoRA adapter {module.name!r}: cannot read {path}: {exc}") from None
    if not isinstance(state, dict):
        raise ValueError(f"LoRA adapter {module.name!r}: {path} does not hold a dict of tensors")
    return state


def stack_shards(base: nn.Module, shards: dict[int, tuple[torch.Tensor, torch.Tensor]], name: str,
           target: str) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One adapter's A and B of one layer as one pair: the shards' A stacked, [sum of ranks, in], and B [out, sum of
    ranks] with each shard's B in its rows and its rank's columns (zeros elsewhere)."""
    sizes = getattr(base, "shard_sizes", None) or [base.out_features]
    rows = {i: (sum(sizes[:i]), size) for i, size in enumerate(sizes)} | {WHOLE: (0, base.out_features)}
    if WHOLE in shards and len(shards) > 1:
        raise ValueError(f"LoRA adapter {name!r}: {target} is changed both whole and by its parts")
    for shard, (a, b) in shards.items():
        r, size = a.shape[0], rows[shard][1]
        if a.shape != (r, base.in_features) or b.shape != (size, r):
            part = "" if shard == WHOLE else f" (shard {shard})"
            raise ValueError(
                f"LoRA adapter {name!r}: {target}{part} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, the layer takes [r, {base.in_features}] and [{size}, r]"
            )
    order = sorted(shards)
    a_all = torch.cat([shards[shard][0] for shard in order])
    b_all = torch.zeros(sum(sizes), len(a_all))
    column = 0
    for shard in order:
        b = shards[shard][1]
        start, size = rows[shard]
        b_all[start : start + size, column : column + b.shape[1]] = b
        column += b.shape[1]
    return a_all, b_all
