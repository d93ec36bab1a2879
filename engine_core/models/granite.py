"""IBM's Granite 3 (GraniteForCausalLM): the Llama layer with four multipliers from its config. Embeddings are
scaled by `embedding_multiplier`; each attention and MLP output by `residual_multiplier` before it joins the
residual stream; attention scores by `attention_multiplier` (in place of 1/sqrt(head_dim)); logits are divided by
`logits_scaling`. The one-call CPU decode stack (engine_core/models/cpu_decode.py) scales the two outputs as these
layers do, and takes the step's embeddings and gives back the final norm's output, so the model's own `embed` and
`compute_logits` apply the other two.

Granite 4.0's attention-only models (GraniteMoeHybridForCausalLM with no Mamba layer and no experts:
granite-4.0-micro, -1b, -350m) are the same layer, its MLP stored as `shared_mlp` (`input_linear`: gate and up
fused, gate first; `output_linear`), rotating q and k only where `position_embedding_type` is "rope"."""

from __future__ import annotations

import copy

import torch

from common.model_errors import ConfigError
from engine_core.attention import AttentionMetadata
from engine_core.models.layers import StepRotary
from engine_core.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.self_attn.scale = config.attention_multiplier
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: StepRotary, meta: AttentionMetadata):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, meta) * self.residual_multiplier  # scaled, then added in the fused norm
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    def decoder_layer(self, index: int, window: int | None, rotate: bool) -> LlamaDecoderLayer:
        qkv_bias, o_bias = self.attention_biases(self.config)
        return GraniteDecoderLayer(self.config, qkv_bias, o_bias, self.heads, self.columns, window, rotate)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling


class GraniteHybridForCausalLM(GraniteForCausalLM):
    def __init__(self, config, max_positions: int) -> None:
        if any(kind not in ("attention", "full_attention") for kind in config.layers_block_type):
            raise ConfigError("Granite 4.0's Mamba layers (its -H models) are not supported: only its attention-only "
                              "models (granite-4.0-micro, -1b, -350m)")  # fmt: skip
        if config.num_local_experts:
            raise ConfigError("Granite 4.0's mixture of experts is not supported: only its dense attention models")
        config = copy.copy(config)
        config.intermediate_size = config.shared_intermediate_size  # the MLP Llama's layer builds
        super().__init__(config, max_positions)

    def decoder_layer(self, index: int, window: int | None, rotate: bool) -> LlamaDecoderLayer:
        return super().decoder_layer(index, window, self.config.position_embedding_type == "rope")

    def checkpoint_name(self, name: str) -> str | None:
        ours = super().checkpoint_name(name)
        if ours is None:
            return None
        return ours.replace(".shared_mlp.input_linear.", ".mlp.gate_up_proj.").replace(
            ".shared_mlp.output_linear.", ".mlp.down_proj.")
