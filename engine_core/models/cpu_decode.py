"""Decode-only CPU steps of a Llama-family model in one C call (csrc/decode_stack.c).

A one-row decode step calls about ten small kernels per layer. Going through the Python layers, each call cost
microseconds of module dispatch, tensor allocation and ctypes: a third of a single stream's step. The stack
runs the same kernels in the same order from C, so its results are bit for bit those of the layers, which stay
the path of every other step (prefill, mixed steps, other devices and dtypes, tensor parallelism) and the reference
the tests compare it with. `DecodeStack.build` answers None for a model it cannot run.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from engine_core.attention import AttentionMetadata, CpuKernelBackend
from engine_core.cpu_kernels import CpuKernels, cpu_kernels
from engine_core.models.layers import PackedLinear
from engine_core.models.quant import Int8Linear

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _PackedWeight(ctypes.Structure):
    _fields_ = [("packed", _P), ("bias", _P), ("q8", _I64)]


class _DecodeLayer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("qkv", _PackedWeight),
                ("o", _PackedWeight), ("gate_up", _PackedWeight), ("down", _PackedWeight), ("k_cache", _P),
                ("v_cache", _P), ("window", _I64)]  # fmt: skip


class _StackShape(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("num_layers", "hidden", "num_q_heads", "num_kv_heads", "head_dim",
                                           "intermediate", "block_size")] + [("eps", ctypes.c_float),
                                                                             ("scale", ctypes.c_float)]  # fmt: skip


def _weight(linear: nn.Module) -> _PackedWeight | None:
    """The kernel's view of a linear our C matmul runs alone (no tensor-parallel sum), else None."""
    if not isinstance(linear, PackedLinear | Int8Linear) or linear.kernels is None or linear.all_reduce:
        return None
    bias = linear.bias
    if bias is not None and bias.dtype != torch.bfloat16:
        return None
    packed = linear.packed_weight
    return _PackedWeight(packed.data_ptr(), None if bias is None else bias.data_ptr(), packed.dtype == torch.int8)


class DecodeStack:
    def __init__(self, model: nn.Module, kernels: CpuKernels, layers: list[_DecodeLayer]) -> None:
        self.model = model  # keeps every tensor the layers' pointers point into alive
        self.rotary = model.rotary
        self.layers = (_DecodeLayer * len(layers))(*layers)
        first = model.layers[0]
        attn = first.self_attn
        self.shape = _StackShape(len(layers), model.config.hidden_size, attn.num_heads, attn.num_kv_heads,
                                 attn.head_dim, first.mlp.down_proj.in_features, attn.k_cache.shape[1],
                                 model.norm.eps, attn.scale)  # fmt: skip
        lib = kernels.lib
        self._work = lib.decode_stack_work
        self._work.argtypes, self._work.restype = [_P, _I64], _I64
        self._run = lib.decode_stack_bf16
        self._run.argtypes = [_P, _P, _P, _P, _P, _I64, _P, _P, _P, _P, _P, _I64, _P, _P]

    @staticmethod
    def build(model: nn.Module) -> DecodeStack | None:
        """For a bf16 Llama-family model whose linears our kernels run and whose layers attend with the CPU
        kernels (the KV caches bound already); None otherwise."""
        from engine_core.models.llama import LlamaForCausalLM  # the model imports this module's type

        kernels = cpu_kernels()
        if type(model) is not LlamaForCausalLM or kernels is None or not kernels.has_linear:  # not Gemma 3's layer
            return None
        if model.norm.weight.dtype != torch.bfloat16:
            return None
        if model.rotary.cos.device.type != "cpu" or model.config.hidden_size > kernels.max_hidden:
            return None
        structs = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights = [_weight(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            caches_ok = attn.k_cache.dtype == torch.bfloat16 and attn.k_cache.is_contiguous()
            q = torch.empty(1, attn.num_heads, attn.head_dim, dtype=torch.bfloat16)
            if None in weights or not isinstance(attn.attn_backend, CpuKernelBackend) or not caches_ok:
                return None
            if not attn.v_cache.is_contiguous() or not kernels.supports_decode(q, attn.k_cache):
                return None
            if any(n is not None and n.eps != model.norm.eps for n in (attn.q_norm, attn.k_norm)):
                return None  # the stack has one eps
            qk_norms = [None if n is None else n.weight.data_ptr() for n in (attn.q_norm, attn.k_norm)]
            structs.append(_DecodeLayer(layer.input_layernorm.weight.data_ptr(),
                                        layer.post_attention_layernorm.weight.data_ptr(), *qk_norms, *weights,
                                        attn.k_cache.data_ptr(), attn.v_cache.data_ptr(),
                                        attn.window or 0))  # fmt: skip
        return DecodeStack(model, kernels, structs)

    @staticmethod
    def takes(meta: AttentionMetadata, rows: int) -> bool:
        """A decode-only step without padding rows, with int64 metadata (what the CPU model runner builds)."""
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        return (
            not meta.prefills
            and meta.num_decodes == rows > 0
            and tables is not None
            and lens is not None
            and tables.dtype == lens.dtype == meta.slot_mapping.dtype == torch.long
        )

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: the step's embeddings [rows, hidden] (overwritten: the stack's scratch). Returns the final norm's
        output, as the model's forward does."""
        rows = x.shape[0]
        x = x.contiguous()
        positions = positions.contiguous()
        tables = meta.decode_block_tables.contiguous()  # type: ignore[union-attr]
        lens = meta.decode_seq_lens.contiguous()  # type: ignore[union-attr]
        slots = meta.slot_mapping.contiguous()
        out = torch.empty_like(x)
        work = torch.empty(self._work(ctypes.byref(self.shape), rows), dtype=torch.bfloat16)
        self._run(self.layers, ctypes.byref(self.shape), self.model.norm.weight.data_ptr(), x.data_ptr(),
                  out.data_ptr(), rows, positions.data_ptr(), self.rotary.cos.data_ptr(), self.rotary.sin.data_ptr(),
                  slots.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(), work.data_ptr())  # fmt: skip
        return out
