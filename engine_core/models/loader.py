"""Builds one of our model classes from an HF-format directory: config via transformers, weights via safetensors."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig
from transformers.initialization import no_init_weights

from engine_core.models.gemma3 import Gemma3ForCausalLM
from engine_core.models.gpt2 import GPT2LMHeadModel
from engine_core.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,  # q/k/v and gate/up fused in the checkpoint, as ours are
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    # The decoder alone, saved from transformers' base classes: embeddings only (common/pooling.py)
    "LlamaModel": LlamaForCausalLM,
    "Qwen2Model": LlamaForCausalLM,
    "Qwen3Model": LlamaForCausalLM,
    "MistralModel": LlamaForCausalLM,
}


class NoLmHead(nn.Module):
    """A pooling engine's LM head (--runner pooling): none. A checkpoint's is left unread, and nothing calls this."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this engine serves embeddings (--runner pooling): it has no LM head")


def model_class(config) -> type[nn.Module]:
    for arch in getattr(config, "architectures", None) or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(f"unsupported architecture {config.architectures}; supported: {', '.join(ARCHITECTURES)}")


def build_model(config, dtype: torch.dtype, device: torch.device, max_positions: int) -> nn.Module:
    """An uninitialised model of the right class, in `dtype` on `device`, in eval mode. Its parameters are left
    empty (the checkpoint fills them): drawing random ones took a second of every engine start."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), no_init_weights():
            model = model_class(config)(config, max_positions)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval().requires_grad_(False)


def load_weights(model: nn.Module, state: dict[str, torch.Tensor] | Path) -> None:
    """Copies checkpoint tensors into `model`, fusing q/k/v and gate/up; fails loudly on a missing weight."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    headless = isinstance(getattr(model, "lm_head", None), NoLmHead)
    for key, tensor in _iter_checkpoint(state):
        name = model.checkpoint_name(key)
        if name is None or (headless and name.startswith("lm_head.")):
            continue
        if hasattr(model, "convert_weight"):  # a layout fix-up, e.g. GPT-2's Conv1D [in, out] weights
            tensor = model.convert_weight(name, tensor)
        if hasattr(model, "shard_weight"):  # tensor parallel: this rank's slice (HF names, before fusing)
            tensor = model.shard_weight(name, tensor)
        for hf_part, (ours, shard) in getattr(model, "packed_modules", {}).items():
            if f".{hf_part}." in name:
                target = name.replace(f".{hf_part}.", f".{ours}.")
                module = model.get_submodule(target.rsplit(".", 1)[0])
                module.load_shard(shard, target.rsplit(".", 1)[1], tensor)
                loaded.add(target)
                break
        else:
            if name not in params:
                raise ValueError(f"unexpected weight {key!r} in checkpoint")
            params[name].data.copy_(tensor)
            loaded.add(name)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"weights missing from checkpoint: {sorted(missing)[:5]}")


def _iter_checkpoint(state: dict[str, torch.Tensor] | Path):
    if isinstance(state, dict):
        yield from state.items()
        return
    files = sorted(Path(state).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {state}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield key, f.get_tensor(key)


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int,
               pooling: bool = False) -> nn.Module:  # fmt: skip
    config = AutoConfig.from_pretrained(path)
    model = build_model(config, dtype, device, max_positions)
    if pooling:
        model.lm_head = NoLmHead()
    load_weights(model, Path(path))
    return model
