"""IBM's Granite 3 (GraniteForCausalLM): the Llama layer with four multipliers from its config. Embeddings are
scaled by `embedding_multiplier`; each attention and MLP output by `residual_multiplier` before it joins the
residual stream; attention scores by `attention_multiplier` (in place of 1/sqrt(head_dim)); logits are divided by
`logits_scaling`. The one-call CPU decode stack has no multipliers, so its decode steps run layer by layer."""

from __future__ import annotations

import torch

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
