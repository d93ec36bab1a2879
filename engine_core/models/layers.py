"""Building blocks shared by our model implementations: norms, rotary embedding, activations, fused linears."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, adds it first and returns (normed, new residual): one pass, no extra add."""
        if residual is not None:
            x = x + residual
            residual = x
        # Same arithmetic as transformers (normalize in fp32, cast back, then scale) for exact parity.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight
        return normed if residual is None else (normed, residual)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin per position; rope scaling comes from transformers' own init functions."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scale = 1.0
        else:
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        inv_freq = inv_freq.float().to(torch.get_default_device())  # the init functions may answer on CPU
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float, device=inv_freq.device), inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per step; every layer reuses the result. Shapes [T, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotate-half layout of HF Llama; x: [T, heads, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class MergedLinear(nn.Linear):
    """Several linears with the same input fused into one matmul; `shard_sizes` tells the loader the layout."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        self.shard_sizes = shard_sizes

    def load_shard(self, index: int, name: str, tensor: torch.Tensor) -> None:
        target = self.weight if name == "weight" else self.bias
        assert target is not None
        start = self.shard_offsets[index]
        target.data[start : start + self.shard_sizes[index]].copy_(tensor)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
