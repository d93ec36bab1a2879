"""A checkpoint quantized before it was saved (config.json's `quantization_config`): which 4-bit layouts of GPTQ,
AWQ and compressed-tensors (llm-compressor's W4A16) the engine serves on its own int4 grid
(engine_core/models/prequantized.py), and a clear error for the rest, checked before the engine starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.model_errors import ModelSourceError

GROUP = 32  # the weights of a row that share a scale and min on our grid (engine_core/linear_packing.py's GROUP)
# vLLM's --quantization names for such checkpoints (its kernels' names too): here each means "the checkpoint's own".
CHECKPOINT_METHODS = {"gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
                      "compressed-tensors": "compressed-tensors"}  # fmt: skip


@dataclass(frozen=True)
class QuantScheme:
    method: str  # "gptq", "awq" or "compressed-tensors"
    group_size: int  # input features per scale; -1: one group for a whole row
    zero_offset: int = 0  # added to each stored zero point: GPTQ's original format stores zero - 1
    symmetric: bool = False  # compressed-tensors: no zero points stored, every zero is 8


def read_scheme(config: dict[str, Any], quantization: str = "none") -> QuantScheme | None:
    """The scheme of config.json's `quantization_config`, or None for a checkpoint of plain weights. Raises
    ModelSourceError for one the engine cannot serve as it is, or for a --quantization that would quantize it
    again on another grid."""
    qc = config.get("quantization_config")
    if qc is None:
        if quantization in CHECKPOINT_METHODS:
            raise ModelSourceError(f"--quantization {quantization}: this checkpoint is not quantized (its config.json "
                                   "has no quantization_config); --quantization int4 or int8 quantizes it at load")
        return None
    if not isinstance(qc, dict):
        raise ModelSourceError("config.json: quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        scheme = _gptq(qc)
    elif method == "awq":
        scheme = _awq(qc)
    elif method == "compressed-tensors":
        scheme = _compressed_tensors(qc)
    else:
        raise ModelSourceError(f"config.json: quant_method {method or None!r} is not supported; 4-bit checkpoints "
                               "of GPTQ, AWQ and compressed-tensors (W4A16) are, and plain ones with --quantization "
                               "int8 or int4")  # fmt: skip
    name = method.upper() if method != "compressed-tensors" else method
    if CHECKPOINT_METHODS.get(quantization, method) != method:
        raise ModelSourceError(f"--quantization {quantization}: this checkpoint is quantized by {name}")
    if quantization == "int8":
        raise ModelSourceError(f"--quantization int8: this checkpoint is already quantized to 4 bits by {name}; "
                               "leave --quantization out to serve it as it is")
    return scheme


def _checked(where: str, bits: Any, group_size: Any) -> int:
    if bits != 4:
        raise ModelSourceError(f"{where} bits={bits} is not supported (4 bits only)")
    if not isinstance(group_size, int) or not (group_size == -1 or (group_size > 0 and group_size % GROUP == 0)):
        raise ModelSourceError(f"{where} group_size={group_size} is not supported (a multiple of {GROUP}, or -1)")
    return group_size


def _gptq(qc: dict[str, Any]) -> QuantScheme:
    where = "config.json: GPTQ with"
    group_size = _checked(where, qc.get("bits"), qc.get("group_size", -1))
    if qc.get("desc_act") and group_size != -1:
        raise ModelSourceError(f"{where} desc_act=true (groups in activation order) is not supported: quantize "
                               "with desc_act=false, as vLLM also asks")  # fmt: skip
    layout = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if layout not in ("gptq", "gptq_v2"):
        raise ModelSourceError(f"{where} checkpoint_format={layout!r} is not supported ('gptq' or 'gptq_v2')")
    return QuantScheme("gptq", group_size, 1 if layout == "gptq" else 0)


def _awq(qc: dict[str, Any]) -> QuantScheme:
    where = "config.json: AWQ with"
    group_size = _checked(where, qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size", -1)))
    if str(qc.get("version", "gemm")).lower() != "gemm":
        raise ModelSourceError(f"{where} version={qc.get('version')!r} is not supported (only 'gemm', AutoAWQ's "
                               "default layout)")  # fmt: skip
    if not qc.get("zero_point", True):
        raise ModelSourceError(f"{where} zero_point=false is not supported")
    return QuantScheme("awq", group_size)


def _compressed_tensors(qc: dict[str, Any]) -> QuantScheme:
    """llm-compressor's W4A16: every config group's weights 4-bit integers per group (or per channel), no
    quantized activations, packed ("pack-quantized")."""
    where = "config.json: compressed-tensors with"
    groups = list((qc.get("config_groups") or {}).values())
    if not groups or not all(isinstance(g, dict) for g in groups):
        raise ModelSourceError(f"{where} no config_groups is not supported")
    weights = [g.get("weights") or {} for g in groups]
    if any(w != weights[0] for w in weights):
        raise ModelSourceError(f"{where} config groups of different weight schemes is not supported")
    w = weights[0]
    formats = {str(g.get("format") or qc.get("format")) for g in groups}
    if formats != {"pack-quantized"}:
        raise ModelSourceError(f"{where} format {sorted(formats)} is not supported (only 'pack-quantized', W4A16)")
    if any(g.get("input_activations") for g in groups):
        raise ModelSourceError(f"{where} quantized activations is not supported (weights only, W4A16)")
    if w.get("type", "int") != "int" or w.get("strategy") not in ("group", "channel"):
        raise ModelSourceError(f"{where} {w.get('type')} weights by {w.get('strategy')} is not supported (integers "
                               "by group or channel)")  # fmt: skip
    if w.get("actorder") == "group":
        raise ModelSourceError(f"{where} actorder='group' (groups in activation order) is not supported")
    group_size = -1 if w.get("strategy") == "channel" else w.get("group_size")
    _checked(where, w.get("num_bits"), group_size)
    return QuantScheme("compressed-tensors", group_size, symmetric=bool(w.get("symmetric", True)))
