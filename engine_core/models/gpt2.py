"""GPT-2: learned positions, pre-LayerNorm blocks, fused q/k/v projection, GELU MLP, tied LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.model_errors import ConfigError
from engine_core import distributed
from engine_core.attention import AttentionBackend, AttentionMetadata, TorchBackend
from engine_core.models.parallel import (
    HeadSplit,
    RowParallelLinear,
    VocabParallelEmbedding,
    head_split,
    lm_head_rows,
    split,
    take_cols,
    take_rows,
    take_vocab_rows,
    vocab_logits,
)

# HF activation name -> torch GELU approximation ("gelu_new" and friends are the tanh form).
_GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}
# HF's GPT-2 checkpoints store these as Conv1D, i.e. weight [in, out]; our nn.Linear wants [out, in].
_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    """With tensor parallelism: this rank's heads; c_proj sums the ranks' partial outputs."""

    def __init__(self, config, layer_idx: int, heads: HeadSplit) -> None:
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads = self.num_kv_heads = heads.num_heads
        self.local_size = self.num_heads * self.head_dim
        self.scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            self.scale /= layer_idx + 1
        self.c_attn = nn.Linear(config.hidden_size, 3 * self.local_size)  # q, k, v fused, equal sizes
        self.c_proj = RowParallelLinear(self.local_size, config.hidden_size)
        self.k_cache = self.v_cache = torch.empty(0)  # bound by the model runner, with its chosen backend
        self.attn_backend: AttentionBackend = TorchBackend()

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = (t.view(-1, self.num_heads, self.head_dim) for t in self.c_attn(x).chunk(3, dim=-1))
        out = self.attn_backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return self.c_proj(out.view(-1, self.local_size))


class GPT2MLP(nn.Module):
    def __init__(self, config, columns: tuple[int, int]) -> None:
        super().__init__()
        inner = columns[1] - columns[0]  # this rank's share of n_inner
        if config.activation_function not in _GELU_APPROXIMATIONS:
            raise ConfigError(f"unsupported GPT-2 activation {config.activation_function!r}")
        self.approximate = _GELU_APPROXIMATIONS[config.activation_function]
        self.c_fc = nn.Linear(config.hidden_size, inner)
        self.c_proj = RowParallelLinear(inner, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class GPT2Block(nn.Module):
    def __init__(self, config, layer_idx: int, heads: HeadSplit, columns: tuple[int, int]) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx, heads)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config, columns)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), meta)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(nn.Module):
    packed_modules: dict[str, tuple[str, int]] = {}  # c_attn is already fused in the checkpoint

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        # max_positions is unused: the learned position table (n_positions rows) is itself the limit.
        size, rank = distributed.tp_size(), distributed.tp_rank()
        self.heads = head_split(config.num_attention_heads, config.num_attention_heads, size, rank)
        self.columns = split(config.n_inner or 4 * config.hidden_size, size, rank)
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.n_positions, config.hidden_size)  # small: whole on every rank
        self.h = nn.ModuleList(
            GPT2Block(config, i, self.heads, self.columns) for i in range(config.num_hidden_layers)
        )
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.hidden_size, lm_head_rows(config.vocab_size), bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight
        attn = self.h[0].attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim

    def attention_layers(self) -> list[nn.Module]:
        return [block.attn for block in self.h]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, meta)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # In the model's dtype: greedy sampling needs no fp32 copy. Rank 0 gets the whole vocabulary.
        return vocab_logits(self.lm_head, hidden, self.config.vocab_size)

    def checkpoint_name(self, name: str) -> str | None:
        """Maps an HF checkpoint key (with or without the "transformer." prefix) to ours; None to skip it."""
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers in old checkpoints
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        return name

    def convert_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Loader hook, after checkpoint_name: HF Conv1D weights are [in, out], nn.Linear wants [out, in]."""
        return tensor.t() if name.endswith(_CONV1D_WEIGHTS) else tensor

    def shard_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Loader hook, after convert_weight: this rank's rows (column-parallel) or columns (row-parallel)."""
        if distributed.tp_size() == 1:
            return tensor
        start, end = self.heads.q_start * self.head_dim, self.heads.q_end * self.head_dim
        c0, c1 = self.columns
        if name in ("wte.weight", "lm_head.weight"):
            return take_vocab_rows(tensor, self.config.vocab_size)
        if ".attn.c_attn." in name:  # q, k and v stacked: this rank's heads of each
            return torch.cat([take_rows(part, start, end) for part in tensor.chunk(3)])
        if ".attn.c_proj." in name:
            return take_cols(tensor, start, end)
        if ".mlp.c_fc." in name:
            return take_rows(tensor, c0, c1)
        if ".mlp.c_proj." in name:
            return take_cols(tensor, c0, c1)
        return tensor
