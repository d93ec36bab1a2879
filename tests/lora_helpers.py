"""The reference a LoRA adapter must match: transformers' model with the adapter merged into its weights (W + scale
B A, as PEFT merges one); what requests name adapters by; the tiny model, adapters and requests the engine tests use.
The adapters themselves: bench/make_random_lora.py."""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path

import msgspec
import torch
from safetensors import safe_open
from transformers import AutoConfig

from bench.make_random_lora import ALL, write_adapter
from common.config import EngineConfig
from common.lora import ADAPTER_WEIGHTS, lora_modules
from common.messages import EngineRequest, LoraRef
from tests.engine_helpers import greedy_request, save_tiny_llama


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


MAX_NEW = 12


def tiny_model_and_adapters(root: Path) -> tuple[str, dict[str, str]]:
    """A tiny random Llama, an adapter on all seven linears (rank 8) and one on q and v (rank 4, rank-stabilized)."""
    model = save_tiny_llama(root / "model", max_positions=512, init=0.2)
    config = AutoConfig.from_pretrained(model)
    every = write_adapter(root / "every", config, ALL, rank=8, alpha=16, seed=1, std=0.2)
    qv = write_adapter(root / "qv", config, ["q_proj", "v_proj"], rank=4, alpha=8, seed=2, std=0.3, use_rslora=True)
    return model, {"every": every, "qv": qv}


def tiny_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 300) for _ in range(n)] for n in (3, 9, 17, 33, 48, 70)]


def lora_request(rid: str, prompt: list[int], lora: LoraRef | None, max_tokens: int = MAX_NEW,
                 **kw) -> EngineRequest:  # fmt: skip
    return msgspec.structs.replace(greedy_request(rid, prompt, max_tokens, **kw), lora=lora)
