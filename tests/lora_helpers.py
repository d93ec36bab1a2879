"""LoRA adapters for the tests, written as PEFT saves them, and the reference they must match: transformers' model
with an adapter merged into its weights (W + scale B A, as PEFT merges one)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.lora import ADAPTER_WEIGHTS

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_PART = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


def layer_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear of a Llama-family decoder layer."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}  # fmt: skip


def write_adapter(path: Path, config, targets: list[str], rank: int, alpha: float, seed: int, std: float = 0.05,
                  **settings) -> str:  # fmt: skip
    """Random A and B (PEFT starts B at zero; a test needs an adapter that changes the output) on every layer."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = layer_shapes(config)
    weights = {}
    for layer in range(config.num_hidden_layers):
        for name in targets:
            fan_in, fan_out = shapes[name]
            prefix = f"base_model.model.model.layers.{layer}.{_PART[name]}.{name}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * std
            weights[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std
    save_file(weights, str(path / ADAPTER_WEIGHTS))
    spec = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "bias": "none", **settings}
    (path / "adapter_config.json").write_text(json.dumps(spec))
    return str(path)


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
