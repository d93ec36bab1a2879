"""Weight-only quantization, at load: every linear layer, the LM head included, keeps its weights in groups of 32 of
a row; activations stay in the model's dtype.
- `--quantization int8`: int8 with one fp32 scale per group (symmetric, as GGUF's Q8_0). One scale per whole row
  (per output channel) flipped greedy tokens of SmolLM2 against bf16 within the first 8 tokens on 7 of 16 parity
  prompts: a few large weights in a row coarsen the step for all the others.
- `--quantization int4`: q in 0..15 with an fp32 scale and min per group, w = scale * q + min (asymmetric, as
  GGUF's Q4_1: a group's range, not its largest magnitude, sets the step; weights from a Q4_1 GGUF, such as the
  default model's layers, come back exactly). The LM head takes int8 (see quantize_linears).

A single stream's decode step is bound by reading the weights: int8 reads 1.25 bytes a weight (the scales
included), int4 0.75, bf16 2. On CPU with bf16 the matmul is our kernel (csrc/linear.c and csrc/linear_int4.c with
AVX512-BF16, csrc/linear_quant_avx2.c with AVX2); elsewhere the weight is dequantized inside each call (correct,
slow). A tied embedding keeps its exact float table
for the lookup: only the head's copy is quantized.
"""

from __future__ import annotations

import logging
from collections import Counter
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from common.gguf_weights import matching_quantization
from common.model_errors import ModelSourceError
from engine_core import distributed
from engine_core.cpu_kernels import cpu_kernels
from engine_core.linear_packing import GROUP, pack_int4, pack_int8
from engine_core.models.grid_fit import dequantize, quantize_int4, quantize_int8
from engine_core.models.grid_weights import grids_wanted
from engine_core.models.layers import PackedLinear, can_pack_bf16, pack_linears, replace_linears
from engine_core.models.parallel import RowParallelLinear

log = logging.getLogger("roseinfer.quant")
BYTES_PER_WEIGHT = {"int8": 1.25, "int4": 0.75}  # the scales (and mins) included


METHODS = {"int8": (quantize_int8, pack_int8), "int4": (quantize_int4, pack_int4)}  # quantize, then pack


class Int4Weights(nn.Module):
    """A linear layer stored quantized in its checkpoint (engine_core/models/prequantized.py), while the checkpoint is
    read: the parts of our int4 grid, filled by name as a linear's weight is (`load_shard` for a fused layer's
    parts), then made a QuantizedLinear by prepare_linears."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        n, k = linear.out_features, linear.in_features
        if k % GROUP:
            raise ModelSourceError(f"a quantized linear of {k} input features: a multiple of {GROUP} is needed")
        self.in_features, self.out_features, self.dtype = k, n, linear.weight.dtype
        self.shard_sizes = getattr(linear, "shard_sizes", None)
        self.shard_offsets = getattr(linear, "shard_offsets", None)
        self.row_parallel = isinstance(linear, RowParallelLinear)
        device = linear.weight.device
        frozen = partial(nn.Parameter, requires_grad=False)
        self.weight_q = frozen(torch.empty(n, k, dtype=torch.uint8, device=device))
        self.weight_scale = frozen(torch.empty(n, k // GROUP, device=device))
        self.weight_min = frozen(torch.empty(n, k // GROUP, device=device))
        self.bias = linear.bias

    def load_shard(self, index: int, name: str, tensor: torch.Tensor) -> None:
        if name == "weight":
            raise ModelSourceError("a fused layer whose parts are stored some quantized, some not")
        target = getattr(self, name)
        start = self.shard_offsets[index]
        target.data[start : start + self.shard_sizes[index]].copy_(tensor)

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.weight_q.data, self.weight_scale.data, self.weight_min.data


class QuantizedLinear(nn.Module):
    """Keeps only what its matmul reads: the kernel's packed panels on CPU in bf16, else the quantized weight and
    its scales (and mins), dequantized in every call. method: "int8" or "int4". From a plain linear, quantized
    here, or from a checkpoint's own int4 weights (Int4Weights)."""

    def __init__(self, linear: nn.Linear | Int4Weights, method: str) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.shard_sizes = getattr(linear, "shard_sizes", None)  # a fused layer's parts (LoRA adapters read them)
        quantize, pack = METHODS[method]
        if isinstance(linear, Int4Weights):
            parts, dtype = linear.parts(), linear.dtype
        else:
            parts, dtype = quantize(linear.weight.detach()), linear.weight.dtype
        self.bias = linear.bias
        # Row-parallel: the partial products are summed over the ranks, and the bias added once, after.
        row_parallel = linear.row_parallel if isinstance(linear, Int4Weights) else isinstance(linear, RowParallelLinear)
        self.all_reduce = row_parallel and distributed.tp_size() > 1
        kernels = cpu_kernels() if parts[0].device.type == "cpu" and dtype == torch.bfloat16 else None
        supported = kernels is not None and kernels.supports_quantized_linear(method, self.in_features)
        self.kernels = kernels if supported else None
        if self.kernels is not None:
            self.register_buffer("packed_weight", pack(*parts, self.kernels.panel_cols))
        else:
            q, scale, *mins = parts
            self.register_buffer("weight_q", q)
            self.register_buffer("scale", scale)
            self.register_buffer("mins", mins[0] if mins else None)  # int4's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.all_reduce else self.bias
        if self.kernels is not None:
            out = self.kernels.linear(x, self.packed_weight, bias, self.out_features)
        else:
            out = F.linear(x, dequantize(self.weight_q, self.scale, self.mins).to(x.dtype), bias)
        if self.all_reduce:
            out = distributed.all_reduce(out)
            return out if self.bias is None else out + self.bias
        return out


def quantize_linears(model: nn.Module, method: str) -> int:
    """Replaces every linear layer by a QuantizedLinear; returns how many. Under int4 the LM head takes int8, as
    llama.cpp's 4-bit files keep their output layer at 6 or 8 bits: its errors land on every logit, and it is one
    linear (a fifth of SmolLM2's weights, far less of a bigger model's)."""

    def make(linear: nn.Linear) -> QuantizedLinear:
        head = linear is getattr(model, "lm_head", None)  # looked up per call: no reference held to the plain head
        return QuantizedLinear(linear, "int8" if head and method == "int4" else method)

    return replace_linears(model, make)


def prepare_linears(model: nn.Module, quantization: str, device: torch.device, dtype: torch.dtype) -> int:
    """At load: int8 or int4 linears when asked for; else, on CPU in bf16 (or in fp32 where csrc/linear_f32.c runs),
    packed ones (see PackedLinear).

    Returns the fewest rows these matmuls must be given for a row's result not to depend on how many rows run
    beside it: a seeded request then draws the same tokens alone as inside a batch. oneDNN's one-row bf16 path
    and MKL's fp32 paths below 4 rows sum in another order than wider calls; our bf16, fp32, int8 and int4 kernels
    do each row alone. On CUDA no row count promises that (cuBLAS picks kernels by shape): 8 there only limits the
    shapes.

    A 4-bit checkpoint's quantized linears (Int4Weights: GPTQ, AWQ, compressed-tensors) become int4
    QuantizedLinears first; the others (the LM head, as such checkpoints keep it) are then treated as any model's.
    """
    grids = getattr(model, "weight_grids", None)  # engine_core/models/grid_weights.py; the loader's, used once
    model.weight_grids = None
    prequantized = _take_int4_weights(model)
    if prequantized:
        log.info("%d linears run the checkpoint's own 4-bit weights, on the int4 grid", prequantized)
    methods = ({quantization} if quantization in ("int8", "int4") else set()) | ({"int4"} if prequantized else set())
    kernels = cpu_kernels()
    for method in sorted(methods):
        if device.type != "cpu" or dtype != torch.bfloat16 or kernels is None or \
                not kernels.supports_quantized_linear(method, GROUP):  # fmt: skip
            log.warning("%s weights on %s %s have no kernel: dequantized in every call (slow)", method, device,
                        dtype)  # fmt: skip
    if quantization in ("int8", "int4"):
        quantize_linears(model, quantization)
        # A layer the kernel cannot take (in_features not a multiple of 32) goes through torch's matmul.
        return 1 if _all_ours(model) else 8
    elif device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
        if not can_pack_bf16():
            log.warning("bf16 on a CPU without AVX512 or AVX2 + FMA: torch emulates its matmuls (slow); --dtype "
                        "float32, the default here, is faster")
            return 8
        pack_linears(model, grids)
        if grids is not None:
            _log_grids(model)
        # Our bf16 kernel does each row alone; oneDNN (where it could not be built) needs 2 rows.
        return 1 if _all_ours(model) else 2
    elif device.type == "cpu" and dtype == torch.float32 and _has_f32_linear():
        pack_linears(model)
        return 1 if _all_ours(model) else 8
    elif device.type == "cpu" and dtype == torch.float16:
        log.warning("float16 on CPU: none of our kernels takes it, so torch runs its matmuls, several times slower "
                    "than float32 or bfloat16; --dtype auto picks the faster of those")  # fmt: skip
    return 8


def _log_grids(model: nn.Module) -> None:
    """Says how many linears kept their checkpoint's grid beside their bf16 panels (grid_weights.py), and the bytes."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear) and m.kernels is not None]
    kept = Counter({torch.int16: "int4", torch.int8: "int8"}[m.packed_few.dtype] for m in linears
                   if m.packed_few is not None)  # fmt: skip
    mib = sum(m.packed_few.numel() * m.packed_few.element_size() for m in linears if m.packed_few is not None) / 2**20
    log.info("%d of %d linears keep their checkpoint's grid (%s), %.0f MiB of panels read by calls of up to %d rows",
             sum(kept.values()), len(linears), ", ".join(f"{n} {kind}" for kind, n in sorted(kept.items())), mib,
             cpu_kernels().grid_rows)  # fmt: skip


def _has_f32_linear() -> bool:
    kernels = cpu_kernels()
    return kernels is not None and kernels.has_f32_linear


def _all_ours(model: nn.Module) -> bool:
    """Whether our kernels run every packed and quantized linear of the model."""
    return all(m.kernels is not None for m in model.modules() if isinstance(m, PackedLinear | QuantizedLinear))


def _take_int4_weights(model: nn.Module) -> int:
    """Every Int4Weights of `model` replaced by its int4 QuantizedLinear; returns how many."""
    return replace_linears(model, lambda weights: QuantizedLinear(weights, "int4"), Int4Weights)


def quantization_hint(model_dir: Path, quantization: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Logs, and returns, what to say at start when a model from a 4- or 8-bit GGUF is served in bf16 where our
    kernel for its grid runs (common/gguf_weights.py): whether its panels keep the grid (grid_weights.py), and which
    --quantization sums on the grid itself."""
    match = matching_quantization(model_dir)
    kernels = cpu_kernels() if device.type == "cpu" and dtype == torch.bfloat16 else None
    if quantization != "none" or match is None or kernels is None:
        return None
    method, kinds = match
    if not kernels.supports_quantized_linear(method, GROUP):
        return None
    hint = f"the GGUF this model came from stored its layers' weights as {kinds}; they are served "
    if grids_wanted(model_dir, dtype, device, quantization):  # the panels keep the grid (the log says how many)
        hint += (f"as the bfloat16 weights they dequantize to, which steps of few rows read from that grid "
                 f"({BYTES_PER_WEIGHT[method]} bytes a weight): --quantization {method} sums on the grid itself "
                 f"instead, faster for a single request and slower for many")  # fmt: skip
    else:
        hint += (f"dequantized to bfloat16 (2 bytes a weight): --quantization {method} serves them on their own "
                 f"grid, in {BYTES_PER_WEIGHT[method]} bytes a weight, faster for few requests at a time")  # fmt: skip
    log.info(hint)
    return hint
