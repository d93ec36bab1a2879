"""What transformers' GGUF loader leaves out of a config, read back from the file's own fields and tensors as
llama.cpp's converter writes them. Without these the model would load and answer wrongly, in silence:
- linear and YaRN rope scaling (`rope.scaling.*`: Gemma 3 4B and larger scale their global layers linearly; the
  128k Qwen GGUFs use YaRN);
- Llama 3's rope scaling (Llama 3.1 to 3.3, and 3.2's 1B and 3B, the most shared GGUFs), stored as the per-frequency
  divisors of a `rope_freqs` tensor: matched against Llama 3's scaling and refused when they do not match it;
- Phi-3's rotated share of each head (Phi-4-mini rotates 3/4), its sliding window, and LongRoPE's factors
  (Phi-3.5-mini, Phi-4-mini);
- the head size (`attention.key_length`) where the loader reads none, as for Qwen3, whose config would otherwise
  take its default of 128 (the weights then fail to load);
- a mixture of experts' expert size (and Qwen2-MoE's shared expert's), and whether the top-k weights are
  renormalized, which llama.cpp decides by architecture (Qwen3-MoE yes, Qwen2-MoE no) where the file says nothing
  (`expert_weights_norm`): transformers' Qwen3-MoE config defaults to no, Qwen3-30B-A3B's says yes."""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

MOE_RENORMALIZES = {"qwen3_moe": True, "qwen2_moe": False}  # llama.cpp's choice per architecture
LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def complete_config(gguf_path: Path, config) -> None:
    """Sets on `config` (from transformers' GGUF loader) what the file says and the loader drops; ValueError for a
    rope scaling we cannot express."""
    reader = gguf.GGUFReader(gguf_path)
    prefix = reader.fields["general.architecture"].contents() + "."
    fields = {name.removeprefix(prefix): f.contents() for name, f in reader.fields.items() if name.startswith(prefix)}
    tensors = {t.name: t.data.tolist() for t in reader.tensors if t.name.startswith(("rope_freqs", "rope_factors_"))}
    if "attention.key_length" in fields and hasattr(config, "head_dim"):
        config.head_dim = fields["attention.key_length"]
    if config.model_type in MOE_RENORMALIZES:
        _complete_moe(config, fields)
    if config.model_type == "phi3":
        _complete_phi3(config, fields, tensors)
    elif "rope_freqs.weight" in tensors:
        config.rope_parameters = _llama3_rope(config, tensors["rope_freqs.weight"])
    elif fields.get("rope.scaling.type", "none") != "none":
        _scaled_rope(config, fields)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _llama3_rope(config, divisors: list[float]) -> dict:
    """Llama 3's rope parameters that give these per-frequency divisors (llama.cpp's rope_freqs)."""
    params = {**(config.rope_parameters or {}), "rope_type": "llama3", "factor": max(divisors), **LLAMA3_SCALING}
    candidate = copy.deepcopy(config)
    candidate.rope_parameters = params
    head_dim = _head_dim(config)
    plain = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](candidate, torch.device("cpu"))
    if len(divisors) != len(plain) or not torch.allclose(plain / torch.tensor(divisors), scaled, rtol=1e-4):
        raise ValueError("its rope_freqs are not Llama 3's rope scaling; serve the model's HF directory instead")
    return params


def _scaled_rope(config, fields: dict) -> None:
    kind, factor = fields["rope.scaling.type"], fields.get("rope.scaling.factor", 1.0)
    if kind not in ("linear", "yarn"):
        raise ValueError(f"its rope scaling {kind!r} is not one this conversion reads; serve the HF directory instead")
    scaling = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = fields["rope.scaling.original_context_length"]
    params = copy.deepcopy(config.rope_parameters)
    if "full_attention" in params:  # Gemma 3: its global layers scale; the sliding ones keep their local base
        params["full_attention"].update(scaling)
    else:
        params.update(scaling)
    config.rope_parameters = params


def _complete_phi3(config, fields: dict, tensors: dict[str, list[float]]) -> None:
    params = dict(config.rope_parameters or {})
    params["partial_rotary_factor"] = fields.get("rope.dimension_count", _head_dim(config)) / _head_dim(config)
    config.sliding_window = fields.get("attention.sliding_window") or None  # Phi-4's converter writes 0 for none
    if "rope_factors_long.weight" in tensors:
        original = fields["rope.scaling.original_context_length"]
        params.update(rope_type="longrope", long_factor=tensors["rope_factors_long.weight"],
                      short_factor=tensors["rope_factors_short.weight"],
                      original_max_position_embeddings=original)  # fmt: skip
        config.original_max_position_embeddings = original
    config.rope_parameters = params


def _complete_moe(config, fields: dict) -> None:
    config.moe_intermediate_size = fields.get("expert_feed_forward_length", config.moe_intermediate_size)
    if "expert_shared_feed_forward_length" in fields:
        config.shared_expert_intermediate_size = fields["expert_shared_feed_forward_length"]
    config.norm_topk_prob = bool(fields.get("expert_weights_norm", MOE_RENORMALIZES[config.model_type]))
