"""Mixture-of-experts models of the Llama family: Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE. Their attention is
Llama's (engine_core/models/llama.py; OLMoE norms each token's whole q and k); in their sparse layers the MLP is a
router and many small SwiGLU experts, of which each token runs its top k, summed with the router's weights
(Qwen2-MoE adds a shared expert every token runs, scaled by a sigmoid gate).

A step groups its (token, choice) slots by expert and runs each expert that has any once over all of them, so an
expert's weights are read once a step however many tokens chose it. On CPU the experts are ordinary linears, so
they are packed for our kernels (or quantized) as every linear is, and one C call runs all of a layer's experts
(csrc/moe.c); decode steps go through the Python layers, not the one-call decode stack. On CUDA the experts'
weights are stacked, and two Triton launches of a grouped matmul run them (engine_core/models/moe_triton.py) without
reading anything on the host, so decode steps replay from CUDA graphs. Each token then sums its k outputs in fp32,
in its own rows only, so its bits do not depend on the rest of the batch.

Tensor parallelism splits every expert's intermediate columns over the ranks, as a dense MLP's are: each rank sums
its partial outputs over the experts and the ranks reduce that sum once, not once per expert.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from common.model_errors import ConfigError
from engine_core import distributed
from engine_core.linear_packing import FORMATS, weight_format
from engine_core.models.layers import PackedLinear
from engine_core.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine_core.models.parallel import split, take_cols, take_rows
from engine_core.models.quant import QuantizedLinear

if TYPE_CHECKING:
    from engine_core.cpu_kernels import CpuKernels


@dataclass(frozen=True)
class MoeShape:
    """What the config says about the experts, read once from either family's names."""

    num_experts: int
    top_k: int
    intermediate: int  # each expert's
    normalize: bool  # the top k weights renormalized to sum to one (Mixtral always; Qwen's norm_topk_prob)
    shared_intermediate: int  # Qwen2-MoE's shared expert (0: none)
    sparse_layers: frozenset[int]

    @staticmethod
    def of(config) -> MoeShape:
        layers = range(config.num_hidden_layers)
        if config.model_type == "mixtral":
            return MoeShape(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True, 0,
                            frozenset(layers))  # fmt: skip
        # Qwen: every decoder_sparse_step-th layer is sparse, but those of mlp_only_layers (dense MLPs); OLMoE: all
        step, dense = getattr(config, "decoder_sparse_step", 1), set(getattr(config, "mlp_only_layers", None) or ())
        sparse = frozenset(i for i in layers if i not in dense and config.num_experts > 0 and (i + 1) % step == 0)
        intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size  # OLMoE: the latter
        return MoeShape(config.num_experts, config.num_experts_per_tok, intermediate,
                        bool(config.norm_topk_prob), getattr(config, "shared_expert_intermediate_size", 0) or 0,
                        sparse)  # fmt: skip


class SparseMoe(nn.Module):
    def __init__(self, config, shape: MoeShape) -> None:
        super().__init__()
        size, rank = distributed.tp_size(), distributed.tp_rank()
        self.top_k, self.normalize = shape.top_k, shape.normalize
        self.gate = nn.Linear(config.hidden_size, shape.num_experts, bias=False)  # the router, whole on every rank
        columns = split(shape.intermediate, size, rank)
        self.experts = nn.ModuleList(LlamaMLP(config, False, columns, down=nn.Linear)
                                     for _ in range(shape.num_experts))  # fmt: skip
        self.shared_expert = self.shared_expert_gate = None
        if shape.shared_intermediate:
            shared_columns = split(shape.shared_intermediate, size, rank)
            self.shared_expert = LlamaMLP(config, False, shared_columns, down=nn.Linear)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self._in_c: ExpertsInC | None | bool = False  # False: not looked at yet (the linears are packed after load)
        self.w13: torch.Tensor | None  # buffers (not parameters: the checkpoint fills them through the experts)
        self.w2: torch.Tensor | None
        self.register_buffer("w13", None, persistent=False)
        self.register_buffer("w2", None, persistent=False)
        if self.gate.weight.device.type == "cuda":  # built on the GPU (build_model's device context)
            self._stack_experts()

    def _stack_experts(self) -> None:
        """The grouped kernels' operands (engine_core/models/moe_triton.py): all experts' gate/up weights in one
        tensor and their down weights in another. Each expert's linears become views into them, so loading the
        checkpoint fills them, and nothing is held twice."""
        first = self.experts[0]
        w13 = first.gate_up_proj.weight.new_empty((len(self.experts), *first.gate_up_proj.weight.shape))
        w2 = first.down_proj.weight.new_empty((len(self.experts), *first.down_proj.weight.shape))
        for i, expert in enumerate(self.experts):
            expert.gate_up_proj.weight = nn.Parameter(w13[i], requires_grad=False)
            expert.down_proj.weight = nn.Parameter(w2[i], requires_grad=False)
        self.w13, self.w2 = w13, w2

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] and their weights [T, k] (fp32), as transformers picks them: the
        softmax over all experts' logits, the k largest, renormalized where the model says so."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        by_choice = self._run_experts(x, experts).view(-1, self.top_k, x.shape[1])
        # Summed in fp32 and in choice order, elementwise: a token's bits depend on nothing else in the step (an
        # index_add_ of the slots would sum in a thread-dependent order on a GPU).
        out = by_choice[:, 0].float() * weights[:, :1]
        for choice in range(1, self.top_k):
            out += by_choice[:, choice].float() * weights[:, choice : choice + 1]
        out = out.to(x.dtype)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return distributed.all_reduce(out) if distributed.tp_size() > 1 else out

    def _run_experts(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each (token, choice) slot's expert output [T * k, hidden], in slot order (token * k + choice)."""
        if self.w13 is not None and self.w2 is not None and x.is_cuda:  # the GPU: no host sync, graph-safe
            from engine_core.models.moe_triton import fused_experts  # imports triton: only where it runs

            return fused_experts(x, self.w13, self.w2, experts)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # the slots grouped by expert
        tokens, counts = order // self.top_k, torch.bincount(flat, minlength=len(self.experts))
        if self._in_c is False:
            self._in_c = ExpertsInC.of(self.experts)
        if self._in_c is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            grouped = self._in_c(x, tokens, counts)
        else:
            grouped, start = x.new_empty((len(flat), x.shape[1])), 0
            for expert, count in zip(self.experts, counts.tolist(), strict=True):
                if count:
                    grouped[start : start + count] = expert(x[tokens[start : start + count]])
                start += count
        out = torch.empty_like(grouped)
        out[order] = grouped
        return out


class ExpertsInC:
    """All of a layer's experts in one call of our CPU kernels (csrc/moe.c), where every expert linear is packed
    for them (bf16, int8 or int4): the same kernels on the same rows as the experts' own calls, so the same bits."""

    def __init__(self, kernels: CpuKernels, gate_up: list[torch.Tensor], down: list[torch.Tensor], fmt: int,
                 intermediate: int) -> None:  # fmt: skip
        self.kernels, self.fmt, self.intermediate = kernels, fmt, intermediate
        self.packed = (gate_up, down)  # kept alive: the tables point into them
        self.gate_up = (ctypes.c_void_p * len(gate_up))(*(t.data_ptr() for t in gate_up))
        self.down = (ctypes.c_void_p * len(down))(*(t.data_ptr() for t in down))

    @staticmethod
    def of(experts: nn.ModuleList) -> ExpertsInC | None:
        linears = [m for e in experts for m in (e.gate_up_proj, e.down_proj)]
        if not all(isinstance(m, PackedLinear | QuantizedLinear) and m.kernels is not None for m in linears):
            return None
        formats = {weight_format(m.packed_weight) for m in linears}
        if len(formats) != 1 or formats == {FORMATS[torch.float32]}:  # csrc/moe.c runs bf16 activations
            return None
        return ExpertsInC(linears[0].kernels, [e.gate_up_proj.packed_weight for e in experts],
                          [e.down_proj.packed_weight for e in experts], formats.pop(),
                          experts[0].down_proj.in_features)  # fmt: skip

    def __call__(self, x: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        x, counts = x.contiguous(), counts.to(torch.int64)
        out = x.new_empty((len(slots), x.shape[1]))
        most = int(counts.max()) if len(slots) else 0
        work = x.new_empty(most * (x.shape[1] + 3 * self.intermediate))
        self.kernels.moe_experts(x, slots, counts, self.gate_up, self.down, self.fmt, self.intermediate, work, out)
        return out


class MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config, max_positions: int) -> None:
        if getattr(config, "clip_qkv", None) is not None:  # an OLMoE option its released checkpoints leave off
            raise ConfigError("clip_qkv is not supported")
        super().__init__(config, max_positions)

    @functools.cached_property
    def moe_shape(self) -> MoeShape:  # read once: every layer and every checkpoint tensor asks
        return MoeShape.of(self.config)

    def decoder_layer(self, index: int, window: int | None, rotate: bool) -> nn.Module:
        shape = self.moe_shape
        qkv_bias, o_bias = self.attention_biases(self.config)
        mlp = SparseMoe(self.config, shape) if index in shape.sparse_layers else None
        return LlamaDecoderLayer(self.config, qkv_bias, o_bias, self.heads, self.columns, window, rotate, mlp)

    def checkpoint_name(self, name: str) -> str | None:
        """Mixtral's names as Qwen's: block_sparse_moe -> mlp, and its experts' w1, w3, w2 -> gate, up, down."""
        if ".block_sparse_moe." in name:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            for old, new in ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
                name = name.replace(old, new)
        return super().checkpoint_name(name)

    def shard_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """An expert's (or the shared expert's) slice of its own intermediate columns; the router is whole."""
        size, rank = distributed.tp_size(), distributed.tp_rank()
        shape = self.moe_shape
        for part, columns in (("experts", shape.intermediate), ("shared_expert", shape.shared_intermediate)):
            if size > 1 and f".mlp.{part}." in name:
                start, end = split(columns, size, rank)
                return take_cols(tensor, start, end) if ".down_proj." in name else take_rows(tensor, start, end)
        return super().shard_weight(name, tensor)
