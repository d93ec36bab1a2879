"""Server-wide sampling defaults, as vLLM's --generation-config: what the model's creator recommends in its
generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty) fills the fields a request leaves
out, and its max_new_tokens caps every request's output."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from frontend.api.protocol import SamplingFields

# generation_config.json's names -> ours; the only keys that become defaults (do_sample, num_beams, ... do not).
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # fmt: skip


class GenerationConfigError(ValueError):
    """A generation config (or its override) that cannot serve: the server stops at start, naming it."""


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None  # a cap on every request's output tokens

    def overridden(self) -> dict[str, Any]:
        """The defaults that differ from the API's own (for the start log)."""
        base = SamplingDefaults()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(base, f.name)}


def load_sampling_defaults(model_path: Path, generation_config: str, override: str | None) -> SamplingDefaults:
    """`generation_config`: "auto" (the model's folder), "vllm" (none: the API's own defaults) or a folder holding a
    generation_config.json; `override`: JSON laid over them."""
    values: dict[str, Any] = {}
    if generation_config != "vllm":
        folder = model_path if generation_config == "auto" else Path(generation_config)
        path = folder / "generation_config.json"
        if generation_config != "auto" and not path.is_file():
            raise GenerationConfigError(f"--generation-config: no generation_config.json in {folder}")
        if path.is_file():
            values = _known(_read_object(path.read_text(), f"--generation-config: {path}"), strict=False)
    if override is not None:
        values |= _known(_read_object(override, "--override-generation-config"), strict=True)
    return _checked(replace(SamplingDefaults(), **values))


def _read_object(text: str, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GenerationConfigError(f"{where} is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise GenerationConfigError(f"{where} must be a JSON object")
    return obj


def _known(obj: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Our names for the keys we take; a key we do not take is an error only where the user wrote it for us."""
    if strict and (unknown := sorted(set(obj) - set(_KEYS))):
        raise GenerationConfigError(f"--override-generation-config: unknown keys {unknown}; known: {sorted(_KEYS)}")
    return {_KEYS[k]: v for k, v in obj.items() if k in _KEYS and v is not None}


def _checked(d: SamplingDefaults) -> SamplingDefaults:
    """Held to a request's own bounds (SamplingFields, strictly typed), so a default can never fail a request."""
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    try:
        SamplingFields.model_validate({name: getattr(d, name) for name in names}, strict=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise GenerationConfigError(f"generation config: {err['loc'][0]} is {err['input']!r}: {err['msg']}") from None
    if d.max_tokens is not None and (type(d.max_tokens) is not int or not 1 <= d.max_tokens <= 2**31 - 1):
        raise GenerationConfigError(f"generation config: max_tokens is {d.max_tokens!r}; it must be an integer in "
                                    f"[1, {2**31 - 1}]")  # fmt: skip
    return replace(d, top_k=max(d.top_k, 0), temperature=float(d.temperature), top_p=float(d.top_p),
                   min_p=float(d.min_p), repetition_penalty=float(d.repetition_penalty))  # fmt: skip
