"""Building blocks shared by our model implementations: norms, rotary embedding, activations, fused linears."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine_core import distributed
from engine_core.cpu_kernels import cpu_kernels
from engine_core.linear_packing import pack_bf16, pack_f32
from engine_core.models.parallel import RowParallelLinear

if TYPE_CHECKING:
    from engine_core.models.grid_weights import GridWeights


def _kernels_for(x: torch.Tensor):
    """Our fused CPU kernels when they can take x (contiguous rows on CPU), else None: use torch."""
    kernels = cpu_kernels() if x.device.type == "cpu" else None
    return kernels if kernels is not None and kernels.handles(x) and x.is_contiguous() and x.dim() == 2 else None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, adds it first and returns (normed, new residual): one pass, no extra add."""
        kernels = _kernels_for(x)
        if kernels is not None and kernels.supports_rms_norm(x, residual, self.weight):
            if residual is None:
                return kernels.rms_norm(x, None, self.weight, self.eps)
            return kernels.rms_norm(x, residual, self.weight, self.eps), residual  # residual updated in place
        if residual is not None:
            x = x + residual
            residual = x
        # Same arithmetic as transformers (normalize in fp32, cast back, then scale) for exact parity.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight
        return normed if residual is None else (normed, residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's: scales by 1 + weight, in fp32 before the cast (its checkpoints store the weight minus one)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = _kernels_for(x)
        if kernels is not None and kernels.supports_rms_norm(x, None, self.weight):
            return kernels.scaled_rms_norm("gemma", x, self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class OlmoRMSNorm(nn.Module):
    """OLMo 2's: normalized and scaled in fp32, rounded to the input's dtype once (transformers' Olmo2RMSNorm); on
    CPU by our kernel, which the one-call decode stack calls too."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = _kernels_for(x)
        if kernels is not None and kernels.supports_rms_norm(x, None, self.weight):
            return kernels.scaled_rms_norm("olmo", x, self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def layer_windows(config, max_positions: int) -> list[int | None]:
    """Each layer's sliding window as transformers applies it (a query sees its last `window` keys), None where the
    layer attends to everything: Mistral 7B v0.1 windows every layer; configs that list `layer_types` (Qwen2 with
    use_sliding_window, Gemma) only their sliding_attention layers. A window no context can pass is no window."""
    window = getattr(config, "sliding_window", None)
    if not window or window >= max_positions or getattr(config, "use_sliding_window", True) is False:
        return [None] * config.num_hidden_layers
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in kinds]


def rope_layers(config) -> list[bool]:
    """Which layers rotate q and k: every one but SmolLM3's NoPE layers (`no_rope_layers`: 0 where a layer has no
    position encoding; transformers fills it in, one layer in four by default)."""
    flags = getattr(config, "no_rope_layers", None)
    return [bool(f) for f in flags] if flags else [True] * config.num_hidden_layers


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin per position; rope scaling comes from transformers' own init functions. `layer_type`:
    the layers' kind where the config gives each its own parameters (Gemma 3: sliding_attention, full_attention).
    `dim`: the leading dims of each head that rotate, all but with a partial_rotary_factor (Phi-4-mini's 0.75)."""

    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        params = params[layer_type] if layer_type is not None else params
        rope_type = params.get("rope_type", "default")
        self.dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, self.dim, 2, dtype=torch.float) / self.dim))
            scale = 1.0
        else:
            kind = {} if layer_type is None else {"layer_type": layer_type}
            if rope_type == "longrope":  # its long factors where a context can pass the original length, as vLLM
                kind["seq_len"] = max_positions  # (transformers switches per forward, so a cached K would not match)
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kind)
        inv_freq = inv_freq.float().to(torch.get_default_device())  # the init functions may answer on CPU
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float, device=inv_freq.device), inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRotary:
        return StepRotary(self, positions, dtype)


class StepRotary:
    """One step's rotary embedding, built once and applied by every layer: the CPU kernel rotates in place from
    the fp32 tables; the torch path gathers cos/sin for the step's positions once, as [T, 1, D]."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.rotary, self.positions = rotary, positions
        self.cos = self.sin = None
        kernel_ok = dtype in (torch.float32, torch.bfloat16) and positions.dtype == torch.int64
        kernel_ok = kernel_ok and positions.is_contiguous()
        if rotary.cos.device.type != "cpu" or not kernel_ok or cpu_kernels() is None:
            self.cos = rotary.cos[positions].unsqueeze(1).to(dtype)
            self.sin = rotary.sin[positions].unsqueeze(1).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] with unit stride inside each row (a view into the qkv projection is fine)."""
        if self.cos is None:
            cpu_kernels().rotary_(x, x.shape[1], x.shape[2], self.positions, self.rotary.cos, self.rotary.sin)
            return x
        dim = self.rotary.dim
        if dim < x.shape[2]:  # a partial rotary: the rest of each head passes through
            return torch.cat((apply_rotary(x[..., :dim], self.cos, self.sin), x[..., dim:]), dim=-1)
        return apply_rotary(x, self.cos, self.sin)


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
    kernels = _kernels_for(x)
    if kernels is not None:
        return kernels.act_and_mul(x, "silu")
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gemma's GeGLU."""
    kernels = _kernels_for(x)
    if kernels is not None:
        return kernels.act_and_mul(x, "gelu_tanh")
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class PackedLinear(nn.Module):
    """A CPU linear layer whose weight is packed once at load for the matmul that runs it: our kernel where it was
    built (bf16: csrc/linear.c, csrc/linear_avx2.c on AVX2; fp32: csrc/linear_f32.c, AVX-512 or AVX2), else, in bf16,
    oneDNN's blocked layout (a plain bf16 linear on CPU reorders its weight inside every call: at 64 decode rows
    that reorder took about 40% of the matmul), else the plain weight. Ours reads the weights at memory speed for a
    few decode rows (SmolLM2 bf16 at 16 rows: 7 ms a step, oneDNN 10.4), keeps up with oneDNN and MKL up to prefill
    sizes, and gives every row the same bits whatever runs beside it."""

    def __init__(self, linear: nn.Linear, grid: torch.Tensor | None = None) -> None:
        """grid: the panels of the grid the bf16 weight lies on bit for bit (engine_core/models/grid_weights.py):
        calls of up to kernels.grid_rows rows then read them, which the kernel widens back to the same bf16
        weights, so both panels give the same bits."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.shard_sizes = getattr(linear, "shard_sizes", None)  # a fused layer's parts (LoRA adapters read them)
        weight = linear.weight.detach()
        kernels = cpu_kernels()
        supported = kernels is not None and kernels.supports_linear(weight.dtype, self.in_features)
        self.kernels = kernels if supported else None
        # Neither (an odd in_features on a CPU without oneDNN's bf16 path): the plain weight, torch's emulation.
        bf16 = weight.dtype == torch.bfloat16
        self.onednn = self.kernels is None and bf16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if self.kernels is not None:
            self.packed_weight = (pack_bf16 if bf16 else pack_f32)(weight, self.kernels.panel_cols)
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 64) if self.onednn else weight
        # A checkpoint's grid, kept beside: calls of few rows wait for the weights' bytes and read it; more rows are
        # bound by the tiles' arithmetic, which the grid's widening would only add to, and read the bf16 panels.
        self.packed_few = grid if self.kernels is not None and bf16 and self.kernels.has_grid_linear else None
        self.bias = linear.bias
        # Row-parallel: the partial products are summed over the ranks, and the bias added once, after.
        self.all_reduce = isinstance(linear, RowParallelLinear) and distributed.tp_size() > 1

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
        if self.kernels is None:
            return F.linear(x, self.packed_weight, bias)
        return self.kernels.linear(x, self._panels(x), bias, self.out_features)

    def _panels(self, x: torch.Tensor) -> torch.Tensor:
        few = self.packed_few is not None and x.numel() <= self.kernels.grid_rows * self.in_features
        return self.packed_few if few else self.packed_weight

    def glu(self, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """act(gate) * up in one kernel call, where this is a merged gate_up layer whose kernel fuses them (AMX);
        else None. act: "silu" or "gelu_tanh", as act_and_mul takes it."""
        if self.kernels is None or self.all_reduce or self.out_features % 2:
            return None
        if self._panels(x) is not self.packed_weight:  # few rows on a grid: linear() reads it
            return None
        return self.kernels.linear_glu(x, self.packed_weight, self.bias, self.out_features // 2, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_reduce:
            out = distributed.all_reduce(self._matmul(x, None))
            return out if self.bias is None else out + self.bias
        return self._matmul(x, self.bias)


def can_pack_bf16() -> bool:
    """Whether PackedLinear runs on this CPU: our kernels (AVX512-BF16, or AVX2 + FMA) or oneDNN's bf16 path,
    which needs AVX512BW/VL/DQ or AVX-NE-CONVERT (elsewhere its reorder raises; a plain bf16 linear still runs,
    emulated)."""
    kernels = cpu_kernels()
    return (kernels is not None and kernels.has_linear) or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: nn.Module, grids: GridWeights | None = None) -> int:
    """Replaces every linear layer of a loaded CPU bf16 or fp32 model by a PackedLinear; returns how many. Tied
    weights stay usable: the embedding keeps the plain tensor, the head gets its packed copy. `grids`: what the
    loader found on a 4- or 8-bit grid."""
    return replace_linears(model, lambda linear: PackedLinear(linear, grids.take(linear) if grids else None))


def replace_linears(model: nn.Module, make: Callable[[nn.Module], nn.Module], kind: type = nn.Linear) -> int:
    """Every nn.Linear (or other `kind`) of `model` replaced by make(linear), one at a time, holding no reference to
    those already replaced: each plain weight is freed once its replacement exists, so a model is never held twice
    (a 13 GB model packed with every plain weight still alive took 26 GB)."""
    names = [name for name, m in model.named_modules() if isinstance(m, kind)]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, make(getattr(parent, attr)))
    return len(names)
