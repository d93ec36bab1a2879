"""AllenAI's OLMo 2 (Olmo2ForCausalLM) and OLMo 3 (Olmo3ForCausalLM): the Llama layer with its norms after the blocks
rather than before them. Each attention and MLP output is RMS-normed, then added to the residual stream (there is no
input norm), and q and k are each normed as one vector over all their heads before the rotation (as OLMoE's, so
the model does not split over tensor-parallel ranks). Its norms scale in fp32 and round once. OLMo 3 adds
sliding-window layers (three in four), each kind of layer with its own rotary parameters, as Gemma 3's. On CPU in
bf16 both run their decode steps through the one-call decode stack (engine_core/models/cpu_decode.py), bit for bit
these layers."""

from __future__ import annotations

import torch
from torch import nn

from engine_core.attention import AttentionMetadata
from engine_core.models.layers import OlmoRMSNorm, RotaryEmbedding, StepRotary
from engine_core.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from engine_core.models.parallel import HeadSplit


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config, heads: HeadSplit, columns: tuple[int, int], window: int | None) -> None:
        super().__init__()
        bias = bool(config.attention_bias)
        self.self_attn = LlamaAttention(config, bias, bias, heads, window, OlmoRMSNorm, qk_norm_whole=True)
        self.mlp = LlamaMLP(config, False, columns)
        self.post_attention_layernorm = OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: StepRotary, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, rope, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(LlamaForCausalLM):
    def decoder_layer(self, index: int, window: int | None, rotate: bool) -> nn.Module:
        return Olmo2DecoderLayer(self.config, self.heads, self.columns, window)

    def final_norm(self) -> nn.Module:
        return OlmoRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def rotary_embedding(self, head_dim: int, max_positions: int) -> nn.Module:
        """One per kind of layer where the config gives each kind its own parameters (OLMo 3), else one."""
        params = getattr(self.config, "rope_parameters", None) or {}
        kinds = set(self.layer_kinds())
        if kinds <= params.keys():
            return nn.ModuleDict({k: RotaryEmbedding(self.config, head_dim, max_positions, k) for k in sorted(kinds)})
        shared = RotaryEmbedding(self.config, head_dim, max_positions)
        return nn.ModuleDict({k: shared for k in sorted(kinds)})

    def layer_kinds(self) -> list[str]:
        return list(getattr(self.config, "layer_types", None) or ["full_attention"] * self.config.num_hidden_layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.decode_stack is not None and self.decode_stack.takes(meta, x.shape[0]):
            return self.decode_stack(x, positions, meta)  # the same layers' kernels, called from C
        ropes = {kind: rotary.for_step(positions, x.dtype) for kind, rotary in self.rotary.items()}
        for layer, kind in zip(self.layers, self.layer_kinds(), strict=True):
            x = layer(x, ropes[kind], meta)
        return self.norm(x)
