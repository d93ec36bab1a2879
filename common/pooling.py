"""The pooling runner (--runner pooling, vLLM's name): which models serve embeddings, and how a prompt's final hidden
states become one.

An embedding model built on a causal decoder (Qwen3-Embedding) is that decoder without its LM head: the embedding is
the final-norm hidden state of the prompt's last token, scaled to length 1. A sentence-transformers
directory says so in its modules.json (Transformer, then Pooling with `pooling_mode_lasttoken`, then Normalize);
without one, last-token pooling and normalizing are the default, as vLLM's for a decoder served as an embedding
model. What the engine computes is the hidden state; the API process cuts it to `dimensions` and normalizes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.model_source import HEADLESS_ARCHITECTURES, ModelSourceError

_ST = "sentence_transformers.models."


@dataclass(frozen=True)
class Pooling:
    size: int  # the hidden size: an embedding's whole length
    normalize: bool  # each embedding scaled to length 1 (after any cut to `dimensions`)
    # The lengths `dimensions` may cut an embedding to, as vLLM reads a config: None, only its whole length (the
    # model says nothing); (), any (is_matryoshka); else those of matryoshka_dimensions.
    dimensions: tuple[int, ...] | None

    def embedding(self, hidden: bytes, length: int | None = None) -> np.ndarray:
        """The embedding from an engine's hidden state (EngineOutput.embedding): its first `length` values (all by
        default), scaled to length 1 if the model normalizes (a zero vector stays zero, as torch's normalize)."""
        vector = np.frombuffer(hidden, dtype="<f4")[: length or self.size]
        if self.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return vector.astype("<f4")


def pick_runner(requested: str, model_dir: Path, architecture: str) -> str:
    """generate or pooling. auto: pooling for a checkpoint with no LM head or a sentence-transformers directory."""
    headless = architecture in HEADLESS_ARCHITECTURES
    if requested == "generate" and headless:
        raise ModelSourceError(f"{model_dir}: {architecture} has no LM head, so it cannot generate; it serves "
                               "embeddings with --runner pooling")  # fmt: skip
    if requested == "auto":
        requested = "pooling" if headless or (model_dir / "modules.json").is_file() else "generate"
    if requested == "pooling":
        read_pooling(model_dir)  # a pooling we cannot compute fails here, at start
    return requested


def read_pooling(model_dir: Path) -> Pooling:
    """The model's pooling, from its sentence-transformers files if it has them."""
    config = _read_json(model_dir / "config.json")
    size = config.get("hidden_size") or config.get("n_embd")  # GPT-2's name
    if not isinstance(size, int):
        raise ModelSourceError(f"{model_dir / 'config.json'} gives no hidden_size")
    dims = config.get("matryoshka_dimensions")
    dimensions = tuple(dims) if isinstance(dims, list) else () if config.get("is_matryoshka") else None
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return Pooling(size, normalize=True, dimensions=dimensions)
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ModelSourceError(f"{modules_path}: not a list of modules")
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(_ST) if isinstance(module, dict) else ""
        if kind == "Pooling":
            _check_last_token(model_dir / str(module.get("path", "")) / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ModelSourceError(f"{modules_path}: the {kind or module!r} module is not supported (only Transformer, "
                                   "last-token Pooling and Normalize)")  # fmt: skip
    return Pooling(size, normalize=normalize, dimensions=dimensions)


def _check_last_token(path: Path) -> None:
    modes = sorted(k.removeprefix("pooling_mode_") for k, v in _read_json(path).items()
                   if k.startswith("pooling_mode_") and v is True)  # fmt: skip
    if modes != ["lasttoken"]:
        raise ModelSourceError(f"{path}: pooling {' + '.join(modes) or 'none'} is not supported (only the last "
                               "token's hidden state, pooling_mode_lasttoken)")  # fmt: skip


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"cannot read {path}: {exc}") from exc
