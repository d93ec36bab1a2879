"""The Llama family (Llama, SmolLM2 and SmolLM3, Qwen2, Qwen3, Mistral, Phi-3): RMSNorm, RoPE, grouped-query
attention, SwiGLU. Our q/k/v and gate/up linears are fused; Phi-3's checkpoints fuse them too, so they load as
they are (tensor parallelism slices them part by part, `_unfused_parts`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from common.model_errors import ConfigError
from engine_core import distributed
from engine_core.attention import AttentionBackend, AttentionMetadata, TorchBackend
from engine_core.models.layers import (
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    StepRotary,
    gelu_tanh_and_mul,
    layer_windows,
    rope_layers,
    silu_and_mul,
)
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

if TYPE_CHECKING:
    from engine_core.models.cpu_decode import DecodeStack


def _heads(config) -> tuple[int, int, int]:
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    return num_heads, num_kv_heads, getattr(config, "head_dim", None) or config.hidden_size // num_heads


class LlamaAttention(nn.Module):
    """With tensor parallelism: this rank's heads (`heads`); o_proj sums the ranks' partial outputs. `qk_norm`
    (Qwen3's RMSNorm, Gemma 3's): every head's q and k normed (one weight over head_dim each) before the rotation;
    with `qk_norm_whole` (OLMoE's), each token's whole q and whole k instead (one weight over all their heads).
    `rotate` False: a layer without position encoding (SmolLM3's NoPE layers, one in four)."""

    def __init__(self, config, qkv_bias: bool, o_bias: bool, heads: HeadSplit, window: int | None,
                 qk_norm: type[nn.Module] | None = None, scale: float | None = None,
                 rotate: bool = True, qk_norm_whole: bool = False) -> None:  # fmt: skip
        super().__init__()
        if qk_norm_whole and distributed.tp_size() > 1:
            raise ConfigError("q/k norms over all heads (OLMoE's) cannot be split over tensor-parallel ranks")
        self.rotate = rotate
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.window = window  # sliding window: each query sees its last `window` keys (None: all)
        self.head_dim = _heads(config)[2]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.qkv_proj = MergedLinear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size], qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = self.k_norm = None
        self.qk_norm_whole = qk_norm_whole
        if qk_norm is not None:
            self.q_norm = qk_norm(self.q_size if qk_norm_whole else self.head_dim, config.rms_norm_eps)
            self.k_norm = qk_norm(self.kv_size if qk_norm_whole else self.head_dim, config.rms_norm_eps)
        self.k_cache = self.v_cache = torch.empty(0)  # bound by the model runner, with its chosen backend
        self.attn_backend: AttentionBackend = TorchBackend()

    def forward(self, x: torch.Tensor, rope: StepRotary, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        if self.q_norm is not None and self.k_norm is not None:  # contiguous rows, as the CPU norm kernel takes
            q_row, k_row = (self.q_size, self.kv_size) if self.qk_norm_whole else (self.head_dim, self.head_dim)
            q = self.q_norm(qkv[:, : self.q_size].reshape(-1, q_row).contiguous())
            k = self.k_norm(qkv[:, self.q_size : qk_size].reshape(-1, k_row).contiguous())
            qk = torch.cat((q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)),
                           dim=1)  # fmt: skip
        else:
            qk = qkv[:, :qk_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.rotate:  # q and k rotated together: one set of elementwise ops (or one kernel call), not two
            qk = rope(qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].view(-1, self.num_kv_heads, self.head_dim)
        out = self.attn_backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.window)
        return self.o_proj(out.view(-1, self.q_size))


class LlamaMLP(nn.Module):
    """act_and_mul: the gate's activation times up (SwiGLU; Gemma's GeGLU). `down`: the output projection's class; a
    plain nn.Linear leaves the ranks' partial sums unreduced (a mixture of experts reduces its sum of experts once)."""

    def __init__(self, config, bias: bool, columns: tuple[int, int], act_and_mul=silu_and_mul,
                 down: type[nn.Linear] = RowParallelLinear) -> None:  # fmt: skip
        super().__init__()
        size = columns[1] - columns[0]  # this rank's intermediate columns
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], bias)
        self.down_proj = down(size, config.hidden_size, bias=bias)
        self.act_and_mul = act_and_mul
        self.act = {silu_and_mul: "silu", gelu_tanh_and_mul: "gelu_tanh"}.get(act_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One kernel call where the packed gate_up layer fuses its activation (PackedLinear.glu, on AMX): the
        # [tokens, 2 x intermediate] product then never goes to memory.
        glu = getattr(self.gate_up_proj, "glu", None) if self.act is not None else None
        hidden = glu(x, self.act) if glu is not None else None
        if hidden is None:
            hidden = self.act_and_mul(self.gate_up_proj(x))
        return self.down_proj(hidden)


class LlamaDecoderLayer(nn.Module):
    """`mlp`: the layer's feed-forward block where it is not the dense MLP (a mixture of experts')."""

    def __init__(self, config, qkv_bias: bool, o_bias: bool, heads: HeadSplit, columns: tuple[int, int],
                 window: int | None, rotate: bool, mlp: nn.Module | None = None) -> None:  # fmt: skip
        super().__init__()
        qk_norm = RMSNorm if config.model_type in ("qwen3", "qwen3_moe", "olmoe") else None
        self.self_attn = LlamaAttention(config, qkv_bias, o_bias, heads, window, qk_norm, rotate=rotate,
                                        qk_norm_whole=config.model_type == "olmoe")  # fmt: skip
        self.mlp = mlp if mlp is not None else LlamaMLP(config, getattr(config, "mlp_bias", False), columns)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, rope, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name -> (our fused parameter, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        size, rank = distributed.tp_size(), distributed.tp_rank()
        self.heads = head_split(*_heads(config)[:2], size, rank)
        self.columns = split(config.intermediate_size, size, rank)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        windows = layer_windows(config, max_positions)
        layers = enumerate(zip(windows, rope_layers(config), strict=True))
        self.layers = nn.ModuleList(self.decoder_layer(i, w, r) for i, (w, r) in layers)
        self.norm = self.final_norm()
        attn = self.layers[0].self_attn
        self.rotary = self.rotary_embedding(attn.head_dim, max_positions)
        self.lm_head = nn.Linear(config.hidden_size, lm_head_rows(config.vocab_size), bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.decode_stack: DecodeStack | None = None  # set by the model runner where it can run (CPU, bf16)

    # What a variant of the family (engine_core/models/gemma3.py) builds its own way:
    def decoder_layer(self, index: int, window: int | None, rotate: bool) -> nn.Module:
        qkv_bias, o_bias = self.attention_biases(self.config)
        return LlamaDecoderLayer(self.config, qkv_bias, o_bias, self.heads, self.columns, window, rotate)

    def final_norm(self) -> nn.Module:
        return RMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def rotary_embedding(self, head_dim: int, max_positions: int) -> nn.Module:
        return RotaryEmbedding(self.config, head_dim, max_positions)

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        if config.model_type == "qwen2":  # Qwen2: biased q/k/v, unbiased output projection (Qwen3: none)
            return True, False
        if config.model_type == "qwen2_moe":
            return bool(config.qkv_bias), False
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings as the first layer takes them (Granite scales them)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        if self.decode_stack is not None and self.decode_stack.takes(meta, x.shape[0]):
            return self.decode_stack(x, positions, meta)  # the same layers' kernels, called from C
        rope = self.rotary.for_step(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # In the model's dtype: greedy sampling needs no fp32 copy. Rank 0 gets the whole vocabulary.
        return vocab_logits(self.lm_head, hidden, self.config.vocab_size)

    def checkpoint_name(self, name: str) -> str | None:
        """Maps an HF checkpoint key to ours; None for keys we do not use."""
        name = name.removeprefix("model.")
        if "rotary_emb" in name:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        return name

    def shard_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Loader hook, with HF names: this rank's rows (column-parallel) or columns (row-parallel) of a weight."""
        if distributed.tp_size() == 1:
            return tensor
        fused = self._unfused_parts(name, tensor)
        if fused is not None:  # each part's slice, fused again
            return torch.cat([self.shard_weight(part_name, part) for part_name, part in fused])
        h, hd, (c0, c1) = self.heads, self.head_dim, self.columns
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return take_vocab_rows(tensor, self.config.vocab_size)
        if ".q_proj." in name:
            return take_rows(tensor, h.q_start * hd, h.q_end * hd)
        if ".k_proj." in name or ".v_proj." in name:
            return take_rows(tensor, h.kv_start * hd, h.kv_end * hd)
        if ".o_proj." in name:
            return take_cols(tensor, h.q_start * hd, h.q_end * hd)
        if ".gate_proj." in name or ".up_proj." in name:
            return take_rows(tensor, c0, c1)
        if ".down_proj." in name:
            return take_cols(tensor, c0, c1)
        return tensor

    def _unfused_parts(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """A checkpoint's fused q/k/v or gate/up weight (Phi-3 stores them so) as its parts under the separate
        names, or None for any other weight."""
        num_heads, num_kv_heads, head_dim = _heads(self.config)
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        half = tensor.shape[0] // 2
        for fused, parts, sizes in ((".qkv_proj.", ("q_proj", "k_proj", "v_proj"), [q, kv, kv]),
                                    (".gate_up_proj.", ("gate_proj", "up_proj"), [half, half])):  # fmt: skip
            if fused in name:
                pieces = tensor.split(sizes)
                return [(name.replace(fused, f".{p}."), t) for p, t in zip(parts, pieces, strict=True)]
        return None
