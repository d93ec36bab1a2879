"""The reference a LoRA adapter must match: transformers' model with the adapter merged into its weights (W + scale
B A, as PEFT merges one), and what requests name adapters by. The adapters themselves: bench/make_random_lora.py."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from common.config import EngineConfig
from common.lora import ADAPTER_WEIGHTS, lora_modules
from common.messages import LoraRef


def merged(model: torch.nn.Module, adapter: str) -> torch.nn.Module:
    """A copy of an HF model with the adapter merged into its weights, in fp32."""
    spec = json.loads((Path(adapter) / "adapter_config.json").read_text())
    out = copy.deepcopy(model).float()
    with safe_open(str(Path(adapter) / ADAPTER_WEIGHTS), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118
            if not key.endswith(".lora_A.weight"):
                continue
            a, b = f.get_tensor(key).double(), f.get_tensor(key.replace("lora_A", "lora_B")).double()
            rank = a.shape[0]
            scale = spec["lora_alpha"] / (math.sqrt(rank) if spec.get("use_rslora") else rank)
            linear = out.get_submodule(key.removeprefix("base_model.model.").removesuffix(".lora_A.weight"))
            linear.weight.data = (linear.weight.double() + scale * b @ a).float()
    return out


def refs(config: EngineConfig) -> dict[str, LoraRef]:
    """What requests name the adapters of the config's --lora-modules by, as the API numbers them."""
    return {m.name: m.ref for m in lora_modules(config)}
