"""A checkpoint quantized before it was saved (config.json's `quantization_config`): which of GPTQ's and AWQ's 4-bit
layouts the engine serves on its own int4 grid (engine_core/models/gptq_awq.py), and a clear error for the rest,
checked before the engine starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.model_errors import ModelSourceError

GROUP = 32  # the weights of a row that share a scale and min on our grid (engine_core/linear_packing.py's GROUP)
# vLLM's --quantization names for such checkpoints (its kernels' names too): here each means "the checkpoint's own".
CHECKPOINT_METHODS = {"gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq"}


@dataclass(frozen=True)
class QuantScheme:
    method: str  # "gptq" or "awq"
    group_size: int  # input features per scale; -1: one group for a whole row
    zero_offset: int  # added to each stored zero point: GPTQ's original format stores zero - 1


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
    if method not in ("gptq", "awq"):
        raise ModelSourceError(f"config.json: quant_method {method or None!r} is not supported; checkpoints quantized "
                               "by GPTQ or AWQ (4 bits) are, and plain ones with --quantization int8 or int4")
    bits = qc.get("bits", qc.get("w_bit"))
    group_size = qc.get("group_size", qc.get("q_group_size", -1))
    where = f"config.json: {method.upper()} with"
    if bits != 4:
        raise ModelSourceError(f"{where} bits={bits} is not supported (4 bits only)")
    if not isinstance(group_size, int) or not (group_size == -1 or (group_size > 0 and group_size % GROUP == 0)):
        raise ModelSourceError(f"{where} group_size={group_size} is not supported (a multiple of {GROUP}, or -1)")
    if method == "awq":
        if str(qc.get("version", "gemm")).lower() != "gemm":
            raise ModelSourceError(f"{where} version={qc.get('version')!r} is not supported (only 'gemm', AutoAWQ's "
                                   "default layout)")
        if not qc.get("zero_point", True):
            raise ModelSourceError(f"{where} zero_point=false is not supported")
        offset = 0
    else:
        if qc.get("desc_act") and group_size != -1:
            raise ModelSourceError(f"{where} desc_act=true (groups in activation order) is not supported: quantize "
                                   "with desc_act=false, as vLLM also asks")
        layout = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if layout not in ("gptq", "gptq_v2"):
            raise ModelSourceError(f"{where} checkpoint_format={layout!r} is not supported ('gptq' or 'gptq_v2')")
        offset = 1 if layout == "gptq" else 0
    if CHECKPOINT_METHODS.get(quantization, method) != method:
        raise ModelSourceError(f"--quantization {quantization}: this checkpoint is quantized by {method.upper()}")
    if quantization == "int8":
        raise ModelSourceError(f"--quantization int8: this checkpoint is already quantized to 4 bits by "
                               f"{method.upper()}; leave --quantization out to serve it as it is")
    return QuantScheme(method, group_size, offset)
