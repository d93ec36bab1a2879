"""LoRA adapters as the flags name them (`--lora-modules`, vLLM's syntax) and as PEFT saves them: what both processes
check before any weight loads. The engine applies them (engine_core/lora.py); the API serves each under its name."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from common.messages import LoraRef

if TYPE_CHECKING:
    from common.config import EngineConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
LEGACY_WEIGHTS = "adapter_model.bin"  # what PEFT saved before safetensors (a pickle: read with torch's weights_only)


class LoraNotFound(ValueError):
    """The adapter's directory is not there (the API answers 404, as vLLM does)."""


def weights_file(folder: Path) -> Path | None:
    """An adapter's weights: PEFT's safetensors file, else its older .bin."""
    return next((folder / name for name in (ADAPTER_WEIGHTS, LEGACY_WEIGHTS) if (folder / name).is_file()), None)


@dataclass(frozen=True)
class AdapterConfig:
    alpha: float
    rslora: bool  # rank-stabilized: scaled by alpha / sqrt(rank) instead of alpha / rank

    def scale(self, rank: int) -> float:
        """Of a module whose weights have this rank (the config's r is checked against --max-lora-rank)."""
        return self.alpha / (math.sqrt(rank) if self.rslora else rank)


@dataclass(frozen=True)
class LoraModule:
    id: int  # LoraRef.id: --lora-modules' are 1, 2, ... in their order
    name: str  # the `model` a request names to be served by this adapter
    path: str  # a PEFT adapter directory
    config: AdapterConfig  # its adapter_config.json, checked

    @property
    def ref(self) -> LoraRef:
        return LoraRef(self.id, self.name, self.path)

    @staticmethod
    def read(ref: LoraRef, max_rank: int) -> LoraModule:
        """An adapter loaded at run time (the API's /v1/load_lora_adapter), its config checked as at start."""
        return LoraModule(ref.id, ref.name, ref.path, read_adapter_config(ref.name, ref.path, max_rank))


def lora_modules(config: EngineConfig) -> list[LoraModule]:
    """The adapters the flags name, each entry `name=path` or JSON `{"name": ..., "path": ...}` (vLLM's two forms)
    and each adapter's config checked: ValueError naming the first problem, before any weight loads."""
    if config.lora_modules and not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if config.enable_lora and config.tensor_parallel_size > 1:
        raise ValueError("--enable-lora with --tensor-parallel-size > 1 is not supported")
    if config.max_lora_rank < 1:
        raise ValueError("--max-lora-rank must be at least 1")
    modules: list[LoraModule] = []
    for entry in config.lora_modules:
        if entry.lstrip().startswith("{"):
            try:
                spec = json.loads(entry)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules: {entry!r} is not JSON: {exc}") from None
            name, path = (spec.get("name"), spec.get("path")) if isinstance(spec, dict) else (None, None)
        else:
            name, _, path = entry.partition("=")
        if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
            raise ValueError(f'--lora-modules: {entry!r} is neither name=path nor {{"name": ..., "path": ...}}')
        if any(m.name == name for m in modules):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        modules.append(LoraModule(len(modules) + 1, name, path, read_adapter_config(name, path, config.max_lora_rank)))
    return modules


def read_adapter_config(name: str, path: str, max_rank: int) -> AdapterConfig:
    """adapter_config.json, refused with the reason where it asks for more than plain LoRA on linear layers."""
    folder = Path(path)
    where = f"LoRA adapter {name!r} ({path})"
    if not folder.is_dir():
        raise LoraNotFound(f"{where}: no such directory")
    try:
        spec = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: cannot read adapter_config.json: {exc}") from None
    if weights_file(folder) is None:
        raise ValueError(f"{where}: no {ADAPTER_WEIGHTS} or {LEGACY_WEIGHTS}")
    unsupported = {
        "peft_type": spec.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(spec.get("use_dora")),
        "bias": spec.get("bias", "none") != "none",
        "modules_to_save": bool(spec.get("modules_to_save")),
        "rank_pattern": bool(spec.get("rank_pattern")),
        "alpha_pattern": bool(spec.get("alpha_pattern")),
        "fan_in_fan_out": bool(spec.get("fan_in_fan_out")),
    }
    if bad := [key for key, refused in unsupported.items() if refused]:
        raise ValueError(f"{where}: {bad[0]}={spec.get(bad[0])!r} is not supported (plain LoRA on linear layers is)")
    rank, alpha = spec.get("r"), spec.get("lora_alpha", spec.get("r"))
    if type(rank) is not int or rank < 1 or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise ValueError(f"{where}: r must be a positive integer and lora_alpha a number")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
    return AdapterConfig(float(alpha), bool(spec.get("use_rslora")))
