"""The pooling runner (--runner pooling, vLLM's name): which models serve embeddings and scores, and how a prompt's
final hidden states become one.

An embedding model built on a causal decoder (Qwen3-Embedding) is that decoder without its LM head: the embedding is
the final-norm hidden state of the prompt's last token, scaled to length 1. A sentence-transformers
directory says so in its modules.json (Transformer, then Pooling with `pooling_mode_lasttoken`, then Normalize);
without one, last-token pooling and normalizing are the default, as vLLM's for a decoder served as an embedding
model. What the engine computes is the hidden state; the API process cuts it to `dimensions` and normalizes it.

A classifier (a *ForSequenceClassification checkpoint: rerankers, classifiers) puts that hidden state through its
head, one row per label: the engine sends the label logits. A reranker trained as a causal LM (Qwen3-Reranker, which
answers "yes" or "no") becomes one with vLLM's overrides: `classifier_from_token` names the tokens whose LM head rows
are the labels, and `is_original_qwen3_reranker` makes the two rows one, yes minus no, whose sigmoid is yes's
probability against no.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.model_source import CLASSIFIER_ARCHITECTURES, HEADLESS_ARCHITECTURES, ModelSourceError, read_config

_ST = "sentence_transformers.models."


@dataclass(frozen=True)
class Pooling:
    size: int  # how many floats the engine sends: the hidden size (an embedding's whole length), or the labels'
    normalize: bool  # each embedding scaled to length 1 (after any cut to `dimensions`)
    # The lengths `dimensions` may cut an embedding to, as vLLM reads a config: None, only its whole length (the
    # model says nothing); (), any (is_matryoshka); else those of matryoshka_dimensions.
    dimensions: tuple[int, ...] | None
    # A classifier's label names, in the order of its logits; () for an embedding model. Its `size` is their count.
    labels: tuple[str, ...] = ()
    # classifier_from_token: the tokens whose LM head rows are the labels' (two, as yes minus no, if token_difference)
    label_tokens: tuple[str, ...] = ()
    token_difference: bool = False

    @property
    def classifies(self) -> bool:
        return bool(self.labels)

    def embedding(self, hidden: bytes, length: int | None = None) -> np.ndarray:
        """The embedding from an engine's hidden state (EngineOutput.pooled): its first `length` values (all by
        default), scaled to length 1 if the model normalizes (a zero vector stays zero, as torch's normalize)."""
        vector = np.frombuffer(hidden, dtype="<f4")[: length or self.size]
        return (unit_length(vector) if self.normalize else vector).astype("<f4")

    def label_scores(self, logits: bytes, activation: bool = True) -> np.ndarray:
        """A classifier's label probabilities from its logits (EngineOutput.pooled), as vLLM's: a softmax over the
        labels, or a single label's sigmoid (a reranker's relevance); with `activation` off (vLLM's
        use_activation), the logits as they are."""
        values = np.frombuffer(logits, dtype="<f4").astype(np.float64)
        if not activation:
            return values
        if values.size == 1:
            return 1.0 / (1.0 + np.exp(-values))
        exp = np.exp(values - values.max())
        return exp / exp.sum()


def unit_length(vector: np.ndarray) -> np.ndarray:
    """`vector` scaled to length 1 (a zero vector stays zero, as torch's normalize)."""
    return vector / max(float(np.linalg.norm(vector)), 1e-12)


def pick_runner(requested: str, model_dir: Path, architecture: str, overrides: dict | None = None) -> str:
    """generate or pooling. auto: pooling for a checkpoint with no LM head, a classifier or a sentence-transformers
    directory. `architecture`: with --hf-overrides laid over the checkpoint's."""
    pooled_only = architecture in HEADLESS_ARCHITECTURES or architecture in CLASSIFIER_ARCHITECTURES
    if requested == "generate" and pooled_only:
        raise ModelSourceError(f"{model_dir}: {architecture} has no LM head, so it cannot generate; it serves "
                               "embeddings or scores with --runner pooling")  # fmt: skip
    if requested == "auto":
        requested = "pooling" if pooled_only or (model_dir / "modules.json").is_file() else "generate"
    if requested == "pooling":
        read_pooling(model_dir, overrides)  # a pooling we cannot compute fails here, at start
    return requested


def read_pooling(model_dir: Path, overrides: dict | None = None) -> Pooling:
    """The model's pooling: a classifier's labels, or an embedding model's, from its sentence-transformers files if
    it has them. `overrides`: --hf-overrides, parsed."""
    config = read_config(model_dir, overrides)
    size = config.get("hidden_size") or config.get("n_embd")  # GPT-2's name
    if not isinstance(size, int):
        raise ModelSourceError(f"{model_dir / 'config.json'} gives no hidden_size")
    if (config.get("architectures") or [""])[0] in CLASSIFIER_ARCHITECTURES:
        return _classifier(config, model_dir)
    if "classifier_from_token" in config:
        raise ModelSourceError("--hf-overrides: classifier_from_token needs a classifier's architecture, such as "
                               '"architectures": ["Qwen3ForSequenceClassification"]')  # fmt: skip
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


def _classifier(config: dict, model_dir: Path) -> Pooling:
    """A classifier's labels: its classifier_from_token's, or id2label's (transformers' default: two)."""
    tokens = config.get("classifier_from_token")
    if tokens is not None:
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise ModelSourceError("--hf-overrides: classifier_from_token must be a list of tokens, such as "
                                   '["no", "yes"]')  # fmt: skip
        difference = config.get("is_original_qwen3_reranker") is True
        if difference and len(tokens) != 2:
            raise ModelSourceError("--hf-overrides: is_original_qwen3_reranker takes two classifier_from_token "
                                   f"tokens (no, yes), not {len(tokens)}")  # fmt: skip
        labels = (tokens[1],) if difference else tuple(tokens)
        return Pooling(len(labels), False, None, labels, tuple(tokens), difference)
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            labels = tuple(str(name) for _, name in sorted((int(k), v) for k, v in id2label.items()))
        except ValueError:
            raise ModelSourceError(f"{model_dir / 'config.json'}: id2label's keys are not label numbers") from None
    else:
        count = config.get("num_labels", 2)
        if not isinstance(count, int) or count < 1:
            raise ModelSourceError(f"{model_dir / 'config.json'}: num_labels is not a positive number")
        labels = tuple(f"LABEL_{i}" for i in range(count))
    return Pooling(len(labels), False, None, labels)


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
