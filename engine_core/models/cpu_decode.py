"""Decode-only CPU steps of a Llama-family model (Granite's, OLMo 2's and Gemma 3's too) in one C call
(csrc/decode_stack.c).

A one-row decode step calls about ten small kernels per layer. Going through the Python layers, each call cost
microseconds of module dispatch, tensor allocation and ctypes: a third of a single stream's step. The stack
runs the same kernels in the same order from C, so its results are bit for bit those of the layers, which stay
the path of every other step (prefill, mixed steps, other devices and dtypes, tensor parallelism) and the reference
the tests compare it with. `DecodeStack.build` answers None for a model it cannot run. With LoRA adapters
(engine_core/lora.py), `attach_lora` gives the stack each adapter's packed A and B, and each step its adapters'
rows: the stack adds their updates after each linear as the LoraLinear wrappers do.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine_core.attention import AttentionMetadata, CpuKernelBackend
from engine_core.cpu_kernels import CpuKernels, cpu_kernels
from engine_core.linear_packing import weight_format
from engine_core.models.layers import PackedLinear
from engine_core.models.quant import QuantizedLinear

if TYPE_CHECKING:
    from engine_core.lora import LoraLinear, LoraStep

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _PackedWeight(ctypes.Structure):
    _fields_ = [("packed", _P), ("bias", _P), ("format", _I64), ("few", _P), ("few_format", _I64)]


class _DecodeLayer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("attn_out_norm", _P), ("mlp_out_norm", _P), ("q_norm", _P),
                ("k_norm", _P), ("cos", _P), ("sin", _P), ("qkv", _PackedWeight), ("o", _PackedWeight),
                ("gate_up", _PackedWeight), ("down", _PackedWeight), ("k_cache", _P), ("v_cache", _P),
                ("window", _I64), ("lora", _P * 4)]  # fmt: skip


class _LoraPair(ctypes.Structure):
    _fields_ = [("a", _P), ("b", _P), ("rank", _I64)]


class _LoraGroups(ctypes.Structure):
    _fields_ = [("num_groups", _I64), ("adapter", _P), ("offsets", _P), ("rows", _P), ("work", _P)]


LORA_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")  # the C order


class _StackShape(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("num_layers", "hidden", "num_q_heads", "num_kv_heads", "head_dim",
                                           "intermediate", "block_size", "gemma", "rotary_dim", "olmo")]  # fmt: skip
    _fields_ += [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("residual_mult", ctypes.c_float),
                 ("kv_fp8", _I64)]  # fmt: skip


def _weight(linear: nn.Module) -> _PackedWeight | None:
    """The kernel's view of a linear our C matmul runs alone (no tensor-parallel sum), else None."""
    if not isinstance(linear, PackedLinear | QuantizedLinear) or linear.kernels is None or linear.all_reduce:
        return None
    bias = linear.bias
    if bias is not None and bias.dtype != torch.bfloat16:
        return None
    packed, few = linear.packed_weight, getattr(linear, "packed_few", None)  # PackedLinear's grid panels, if any
    return _PackedWeight(packed.data_ptr(), None if bias is None else bias.data_ptr(), weight_format(packed),
                         None if few is None else few.data_ptr(), 0 if few is None else weight_format(few))


def _is_granite(model: nn.Module) -> bool:
    from engine_core.models.granite import GraniteForCausalLM  # imports the Llama model, which imports this module

    return isinstance(model, GraniteForCausalLM)


def _is_olmo(model: nn.Module) -> bool:
    from engine_core.models.olmo2 import Olmo2ForCausalLM  # imports the Llama model, which imports this module

    return isinstance(model, Olmo2ForCausalLM)


def _is_gemma(model: nn.Module) -> bool:
    from engine_core.models.gemma3 import Gemma3ForCausalLM  # imports the Llama model, which imports this module

    return type(model) is Gemma3ForCausalLM


def _rotary_dim(model: nn.Module) -> int:
    rotaries = model.rotary.values() if isinstance(model.rotary, nn.ModuleDict) else [model.rotary]
    (dim,) = {r.dim for r in rotaries}  # one for all of Gemma's kinds of layer
    return dim


def _norms(layer: nn.Module, gemma: bool, olmo: bool) -> tuple[nn.Module | None, ...]:
    """The layer's norms in the C order: before attention, before the MLP, of attention's and the MLP's outputs."""
    if gemma:  # Gemma 3's four
        return (layer.input_layernorm, layer.pre_feedforward_layernorm, layer.post_attention_layernorm,
                layer.post_feedforward_layernorm)  # fmt: skip
    if olmo:  # OLMo 2's two, of the outputs
        return None, None, layer.post_attention_layernorm, layer.post_feedforward_layernorm
    return layer.input_layernorm, layer.post_attention_layernorm, None, None


def _rotary(model: nn.Module, i: int, gemma: bool, olmo: bool) -> nn.Module:
    """Layer i's rotary tables: Gemma's and OLMo's have one per kind of layer."""
    if gemma:
        return model.rotary[model.layer_types[i]]
    return model.rotary[model.layer_kinds()[i]] if olmo else model.rotary


class DecodeStack:
    def __init__(self, model: nn.Module, kernels: CpuKernels, layers: list[_DecodeLayer]) -> None:
        self.model = model  # keeps every tensor the layers' pointers point into alive
        self.layers = (_DecodeLayer * len(layers))(*layers)
        first = model.layers[0]
        attn = first.self_attn
        self.shape = _StackShape(len(layers), model.config.hidden_size, attn.num_heads, attn.num_kv_heads,
                                 attn.head_dim, first.mlp.down_proj.in_features, attn.k_cache.shape[1],
                                 _is_gemma(model), _rotary_dim(model), _is_olmo(model), model.norm.eps, attn.scale,
                                 getattr(first, "residual_multiplier", 1.0),
                                 attn.k_cache.dtype == torch.float8_e4m3fn)  # fmt: skip
        lib = kernels.lib
        self._work = lib.decode_stack_work
        self._work.argtypes, self._work.restype = [_P, _I64], _I64
        self._run = lib.decode_stack_bf16
        self._run.argtypes = [_P, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _P, _P]
        self.lora: LoraStep | None = None  # the adapters' rows of each step, once attach_lora took them
        self._lora_pairs: list = []  # the ctypes arrays the layers' lora pointers point into
        self._lora_width = 0  # bf16 elements of LoRA scratch per row

    def attach_lora(self, wrappers: dict[str, LoraLinear], step: LoraStep) -> bool:
        """Adds the LoRA adapters' updates (engine_core/lora.py) to the linears they change, where our kernel runs
        every A and B; False (and none attached) otherwise: adapter steps then take the Python layers. Each linear's
        array has an entry for every adapter (NULL where the adapter leaves it alone). Called again whenever the
        adapters change: it replaces what the last call attached."""
        for layer in self.layers:
            layer.lora = (_P * 4)()
        self.lora, self._lora_pairs, self._lora_width = None, [], 0
        width = 0
        per_layer = []
        for i in range(len(self.layers)):
            pointers = []
            for name in LORA_LINEARS:
                wrapper = wrappers.get(f"layers.{i}.{name}")
                if wrapper is None:
                    pointers.append(None)
                    continue
                pairs = (_LoraPair * len(wrapper.by_index))()  # zeroed: NULL for the adapters it has none of
                for index, update in enumerate(wrapper.by_index):
                    if update is None:
                        continue
                    shrink, expand = update
                    if _weight(shrink) is None or _weight(expand) is None:  # an odd rank: not our kernel's
                        return False
                    pairs[index] = _LoraPair(shrink.packed_weight.data_ptr(), expand.packed_weight.data_ptr(),
                                             shrink.out_features)  # fmt: skip
                    width = max(width, shrink.in_features + shrink.out_features + expand.out_features)
                self._lora_pairs.append(pairs)
                pointers.append(ctypes.cast(pairs, _P).value)
            per_layer.append(pointers)
        for layer, pointers in zip(self.layers, per_layer, strict=True):
            layer.lora = (_P * 4)(*pointers)
        self.lora, self._lora_width = step, width
        return True

    def _lora_groups(self, rows: int) -> tuple[_LoraGroups, list[torch.Tensor]] | None:
        """This step's adapter rows for the C call, and the tensors it points into (kept alive by the caller)."""
        if self.lora is None or not self.lora.groups:
            return None
        adapter, offsets, ids = [], [0], []
        for index, group_rows, n in self.lora.groups:
            adapter.append(index)
            ids.append(torch.arange(rows) if group_rows is None else group_rows[:n])
            offsets.append(offsets[-1] + n)
        tensors = [torch.tensor(adapter), torch.tensor(offsets), torch.cat(ids).contiguous(),
                   torch.empty(rows * self._lora_width, dtype=torch.bfloat16)]  # fmt: skip
        return _LoraGroups(len(adapter), *(t.data_ptr() for t in tensors)), tensors

    @staticmethod
    def build(model: nn.Module) -> DecodeStack | None:
        """For a bf16 Llama-family (Granite's multipliers included), OLMo 2 or Gemma 3 model whose linears our
        kernels run and whose layers attend with the CPU kernels (the KV caches bound already); None otherwise."""
        from engine_core.models.llama import LlamaForCausalLM  # the model imports this module's type

        kernels, gemma, olmo = cpu_kernels(), _is_gemma(model), _is_olmo(model)
        llama = type(model) is LlamaForCausalLM or _is_granite(model)  # Granite: Llama's layer with multipliers
        if not (llama or gemma or olmo) or kernels is None or not kernels.has_linear:
            return None
        if model.norm.weight.dtype != torch.bfloat16:
            return None
        if model.embed_tokens.weight.device.type != "cpu" or model.config.hidden_size > kernels.max_hidden:
            return None
        structs = []
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            weights = [_weight(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            caches_ok = attn.k_cache.dtype in (torch.bfloat16, torch.float8_e4m3fn) and attn.k_cache.is_contiguous()
            q = torch.empty(1, attn.num_heads, attn.head_dim, dtype=torch.bfloat16)
            if None in weights or not isinstance(attn.attn_backend, CpuKernelBackend) or not caches_ok:
                return None
            if not attn.v_cache.is_contiguous() or not kernels.supports_decode(q, attn.k_cache):
                return None
            if any(n is not None and n.eps != model.norm.eps for n in (attn.q_norm, attn.k_norm)):
                return None  # the stack has one eps
            norms = [None if n is None else n.weight.data_ptr() for n in (*_norms(layer, gemma, olmo), attn.q_norm,
                                                                          attn.k_norm)]  # fmt: skip
            rotary = _rotary(model, i, gemma, olmo)
            cos, sin = (rotary.cos.data_ptr(), rotary.sin.data_ptr()) if attn.rotate else (None, None)  # NULL: NoPE
            structs.append(_DecodeLayer(*norms, cos, sin, *weights,
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
        lora = self._lora_groups(rows)
        self._run(self.layers, ctypes.byref(self.shape), self.model.norm.weight.data_ptr(), x.data_ptr(),
                  out.data_ptr(), rows, positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1],
                  lens.data_ptr(), work.data_ptr(), None if lora is None else ctypes.byref(lora[0]))  # fmt: skip
        return out
