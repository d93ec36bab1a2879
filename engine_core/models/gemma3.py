"""Gemma 3 text models (Gemma3ForCausalLM: the 270M and 1B checkpoints): the Llama layer with Gemma's changes.

RMSNorm scales by 1 + weight, in fp32 before the cast (the checkpoint stores the weight minus one); embeddings are
scaled by sqrt(hidden) in their own dtype; every q and k head is normed; scores are scaled by
query_pre_attn_scalar; the MLP is GeGLU; a norm follows attention and the MLP as well as preceding them; and the
layers of each kind (layer_types: five sliding_attention layers to one full_attention) have their own rotary base,
the sliding ones their window. Weights, tensor-parallel slices and the LM head are Llama's.
"""

from __future__ import annotations

import torch
from torch import nn

from common.model_errors import ConfigError
from engine_core.attention import AttentionMetadata
from engine_core.models.layers import GemmaRMSNorm, RotaryEmbedding, StepRotary, gelu_tanh_and_mul
from engine_core.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from engine_core.models.parallel import HeadSplit


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, heads: HeadSplit, columns: tuple[int, int], window: int | None) -> None:
        super().__init__()
        bias = bool(config.attention_bias)
        self.self_attn = LlamaAttention(config, bias, bias, heads, window, GemmaRMSNorm,
                                        config.query_pre_attn_scalar**-0.5)  # fmt: skip
        self.mlp = LlamaMLP(config, False, columns, gelu_tanh_and_mul)
        norm = lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, x: torch.Tensor, rope: StepRotary, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, max_positions: int) -> None:
        if getattr(config, "attn_logit_softcapping", None) is not None:  # Gemma 2's: the kernels have no softcap
            raise ConfigError("attention logit softcapping is not supported")
        if getattr(config, "use_bidirectional_attention", False):
            raise ConfigError("bidirectional attention (an embedding model's) is not supported")
        super().__init__(config, max_positions)
        self.layer_types = list(config.layer_types)
        self.embed_scale = config.hidden_size**0.5

    def decoder_layer(self, index: int, window: int | None, rotate: bool) -> nn.Module:  # every Gemma layer rotates
        return Gemma3DecoderLayer(self.config, self.heads, self.columns, window)

    def final_norm(self) -> nn.Module:
        return GemmaRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def rotary_embedding(self, head_dim: int, max_positions: int) -> nn.Module:
        """One per kind of layer, each with its own rotary base (and scaling)."""
        kinds = sorted(set(self.config.layer_types))
        return nn.ModuleDict({k: RotaryEmbedding(self.config, head_dim, max_positions, k) for k in kinds})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the weights' dtype first, as transformers
        if self.decode_stack is not None and self.decode_stack.takes(meta, x.shape[0]):
            return self.decode_stack(x, positions, meta)  # the same layers' kernels, called from C
        ropes = {kind: rotary.for_step(positions, x.dtype) for kind, rotary in self.rotary.items()}
        for layer, kind in zip(self.layers, self.layer_types, strict=True):
            x = layer(x, ropes[kind], meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap
