"""A random-weight LoRA adapter in PEFT's format (adapter_config.json, adapter_model.safetensors) for a Llama-family
model directory: for benchmarks and tests that serve adapters without a model hub. PEFT starts B at zero; these draw
both A and B, so the adapter changes the model's answers.

python -m bench.make_random_lora MODEL_DIR OUT_DIR [--rank 16] [--alpha 16] [--targets q_proj,...] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from common.lora import ADAPTER_WEIGHTS

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ALL_FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3's layers, as its checkpoints name them
_PART = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "qkv_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "gate_up_proj": "mlp",
         "down_proj": "mlp"}  # fmt: skip


def layer_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear of a Llama-family decoder layer (and of Phi-3's fused ones)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
            "qkv_proj": (hidden, q + 2 * kv), "gate_up_proj": (hidden, 2 * inter)}  # fmt: skip


def write_adapter(path: Path, config, targets: list[str], rank: int, alpha: float, seed: int, std: float = 0.05,
                  **settings) -> str:  # fmt: skip
    """Every layer's `targets` get A [rank, in] and B [out, rank] of N(0, std); `settings` go into the config."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--targets", default=",".join(ALL), help="comma-separated linears of each layer")
    parser.add_argument("--std", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(args.model_dir)
    print(write_adapter(Path(args.out_dir), config, args.targets.split(","), args.rank, args.alpha, args.seed,
                        args.std))  # fmt: skip


if __name__ == "__main__":
    main()
