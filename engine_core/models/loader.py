"""Builds one of our model classes from an HF-format directory: config via transformers, weights via safetensors."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from torch import nn
from transformers import AutoConfig
from transformers.initialization import no_init_weights

from common.checkpoint_quant import QuantScheme, read_scheme
from common.model_errors import ConfigError
from common.model_source import ModelSourceError, read_config
from common.pooling import Pooling
from engine_core.models.gemma3 import Gemma3ForCausalLM
from engine_core.models.gpt2 import GPT2LMHeadModel
from engine_core.models.granite import GraniteForCausalLM, GraniteHybridForCausalLM
from engine_core.models.grid_weights import GridWeights, grids_wanted
from engine_core.models.llama import LlamaForCausalLM
from engine_core.models.moe import MoeForCausalLM
from engine_core.models.olmo2 import Olmo2ForCausalLM
from engine_core.models.prequantized import (
    quantized_prefixes,
    shard_part,
    take_quantized_linears,
    unpack_checkpoint,
)

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,  # q/k/v and gate/up fused in the checkpoint, as ours are
    "GraniteForCausalLM": GraniteForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteHybridForCausalLM,  # Granite 4.0: its attention-only, dense models
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo2ForCausalLM,  # OLMo 2 with sliding-window layers
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "OlmoeForCausalLM": MoeForCausalLM,
    # The decoder alone, saved from transformers' base classes: embeddings only (common/pooling.py)
    "LlamaModel": LlamaForCausalLM,
    "Qwen2Model": LlamaForCausalLM,
    "Qwen3Model": LlamaForCausalLM,
    "MistralModel": LlamaForCausalLM,
    # The decoder and a classifier's head (ClassifierHead): scores only
    "LlamaForSequenceClassification": LlamaForCausalLM,
    "Qwen2ForSequenceClassification": LlamaForCausalLM,
    "Qwen3ForSequenceClassification": LlamaForCausalLM,
    "MistralForSequenceClassification": LlamaForCausalLM,
}


class NoLmHead(nn.Module):
    """An embedding engine's LM head (--runner pooling): none. A checkpoint's is left unread; what a request pools
    to is its last position's hidden state."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this engine serves embeddings (--runner pooling): it has no LM head")

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float()


class ClassifierHead(nn.Module):
    """A classifier engine's LM head (--runner pooling): one row per label, in float32, applied to the last
    position's hidden state. The rows are a *ForSequenceClassification checkpoint's `score.weight`, or those of the
    tokens of classifier_from_token in the checkpoint's LM head (its embeddings, if tied), whose other rows are left
    unread (common/pooling.py)."""

    def __init__(self, hidden_size: int, pooling: Pooling, token_ids: list[int], device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(pooling.size, hidden_size, device=device), requires_grad=False)
        self.token_ids = token_ids
        self.difference = pooling.token_difference

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this engine serves scores (--runner pooling): it has no LM head")

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float() @ self.weight.T

    def source(self, tied: bool) -> str:
        """The checkpoint tensor its rows come from, named without the "model." prefix."""
        return "score.weight" if not self.token_ids else "embed_tokens.weight" if tied else "lm_head.weight"

    def take(self, tensor: torch.Tensor) -> None:
        rows = tensor[self.token_ids].float() if self.token_ids else tensor.float()
        self.weight.copy_(rows[1:] - rows[:1] if self.difference else rows)


def pooling_head(config, pooling: Pooling, path: Path, device: torch.device) -> nn.Module:
    """What replaces a pooling engine's LM head: nothing (embeddings), or a classifier's head."""
    if not pooling.classifies:
        return NoLmHead()
    token_ids = []
    if pooling.label_tokens:
        vocab = Tokenizer.from_file(str(path / "tokenizer.json"))
        for token in pooling.label_tokens:
            if (token_id := vocab.token_to_id(token)) is None:
                raise ModelSourceError(f"classifier_from_token: {token!r} is not a token of this model's vocabulary")
            token_ids.append(token_id)
    return ClassifierHead(config.hidden_size, pooling, token_ids, device)


def load_config(path: str | Path, overrides: dict | None = None):
    """transformers' config of the model, with --hf-overrides (parsed) laid over it."""
    config = AutoConfig.from_pretrained(path)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return config


def model_class(config) -> type[nn.Module]:
    for arch in getattr(config, "architectures", None) or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ConfigError(f"unsupported architecture {config.architectures}; supported: {', '.join(ARCHITECTURES)}")


def build_model(config, dtype: torch.dtype, device: torch.device, max_positions: int) -> nn.Module:
    """An uninitialised model of the right class, in `dtype` on `device`, in eval mode. Its parameters are left
    empty (the checkpoint fills them): drawing random ones took a second of every engine start."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), no_init_weights():
            model = model_class(config)(config, max_positions)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval().requires_grad_(False)


def module_of(model: nn.Module, key: str) -> tuple[str, int | None] | None:
    """The module a checkpoint weight (its key) is loaded into, and its part of a fused layer (None: a whole
    weight); None for a key the model does not use."""
    name = model.checkpoint_name(key)
    if name is None:
        return None
    for hf_part, (ours, shard) in getattr(model, "packed_modules", {}).items():
        if f".{hf_part}." in name:
            return name.replace(f".{hf_part}.", f".{ours}.").rsplit(".", 1)[0], shard
    return name.rsplit(".", 1)[0], None


def load_weights(model: nn.Module, state: dict[str, torch.Tensor] | Path, scheme: QuantScheme | None = None,
                 grids: GridWeights | None = None) -> None:
    """Copies checkpoint tensors into `model`, fusing q/k/v and gate/up; fails loudly on a missing weight. `scheme`:
    a 4-bit checkpoint's (GPTQ, AWQ, compressed-tensors), whose quantized linears take_quantized_linears made
    Int4Weights. `grids`: offered each tensor a linear's weight is loaded from (engine_core/models/grid_weights.py)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    head = getattr(model, "lm_head", None)
    headless = isinstance(head, NoLmHead | ClassifierHead)
    head_source = head.source(model.config.tie_word_embeddings) if isinstance(head, ClassifierHead) else None
    tensors = _iter_checkpoint(state)
    for key, tensor in unpack_checkpoint(tensors, scheme) if scheme else tensors:
        if key.removeprefix("model.") == head_source:  # whole on every tensor-parallel rank: it is small
            head.take(tensor)
            loaded.add("lm_head.weight")
            if head_source != "embed_tokens.weight":  # tied embeddings are the model's too
                continue
        name = model.checkpoint_name(key)
        if name is None or (headless and name.startswith("lm_head.")):
            continue
        if hasattr(model, "convert_weight"):  # a layout fix-up, e.g. GPT-2's Conv1D [in, out] weights
            tensor = model.convert_weight(name, tensor)
        if hasattr(model, "shard_weight"):  # tensor parallel: this rank's slice (HF names, before fusing)
            tensor = shard_part(model, name, tensor) if scheme else model.shard_weight(name, tensor)
        module, shard = module_of(model, key)
        if shard is not None:  # a part of one of our fused layers
            attr = name.rsplit(".", 1)[1]
            target = model.get_submodule(module)
            target.load_shard(shard, attr, tensor)
            if grids is not None and attr == "weight":
                grids.offer(target.weight, shard, tensor)
            loaded.add(f"{module}.{attr}")
        else:
            if name not in params:
                raise ValueError(f"unexpected weight {key!r} in checkpoint")
            params[name].data.copy_(tensor)
            if grids is not None:
                grids.offer(params[name], None, tensor)
            loaded.add(name)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"weights missing from checkpoint: {sorted(missing)[:5]}")


def _iter_checkpoint(state: dict[str, torch.Tensor] | Path):
    if isinstance(state, dict):
        yield from state.items()
        return
    files = sorted(Path(state).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {state}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield key, f.get_tensor(key)


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int,
               pooling: Pooling | None = None, overrides: dict | None = None,
               tokenizer: Path | None = None, quantization: str = "none") -> nn.Module:  # fmt: skip
    """`quantization`: --quantization, which a 4-bit checkpoint must not contradict (common/checkpoint_quant.py).
    `pooling`: a pooling engine's (--runner pooling), whose model has a pooling head instead of its LM head (a
    classifier's label tokens are looked up in `tokenizer`'s directory, by default the model's)."""
    config = load_config(path, overrides)
    scheme = read_scheme(read_config(Path(path), overrides), quantization)
    model = build_model(config, dtype, device, max_positions)
    if pooling is not None:
        model.lm_head = pooling_head(config, pooling, tokenizer or Path(path), device)
    if scheme is not None:  # a 4-bit checkpoint: its quantized linears are never widened to floats
        take_quantized_linears(model, quantized_prefixes(Path(path)), partial(module_of, model))
    # A GGUF's 4- or 8-bit layers, served in bf16 on CPU: what lies on its grid stays there (prepare_linears packs it)
    grids = GridWeights(model) if grids_wanted(Path(path), dtype, device, quantization) else None
    load_weights(model, Path(path), scheme, grids)
    model.weight_grids = grids
    return model
