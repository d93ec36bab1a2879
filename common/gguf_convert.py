"""A GGUF file -> an HF directory (config.json, generation_config.json, float32 safetensors, the tokenizer), once per
file (common/model_source.py caches it). transformers reads the config, the dequantized tensors and the tokenizer;
common/gguf_fields.py adds what its loader drops, and common/gguf_weights.py records how the layers were quantized.

Memory: the weights are dequantized a group of whole layers at a time (GROUP_BYTES of float32), each group written
as its own safetensors shard before the next is read, and the model they are checked against has names and shapes
only (the meta device). So converting needs about one group of memory beside the file's mapped pages, whatever the
model's size, and 4 bytes of disk a weight."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from common.model_errors import ModelSourceError

GROUP_BYTES = 2 * 2**30  # float32 bytes of one group of layers (a larger layer is a group alone)


def convert_gguf(gguf_path: Path, out_dir: Path, check_architecture: Callable[[str, Path], object]) -> None:
    """check_architecture(name, gguf_path) raises ModelSourceError for a model the engine cannot build."""
    # Imported here so resolving an already-converted model stays cheap.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from common.gguf_fields import complete_config
    from common.gguf_parse import one_parse
    from common.gguf_weights import record_weight_types

    # from_pretrained(gguf_file=...) requires `accelerate` (not a dependency) and leaves a GGUF quantizer on the
    # model that blocks save_pretrained. Building the model from the GGUF config and loading the dequantized tensors
    # ourselves gives bit-identical weights without either problem. Every reader of the file below shares one parse.
    with _converting(gguf_path), one_parse(gguf_path) as reader:
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        complete_config(gguf_path, config)  # what the loader drops: rope scaling, Phi-3's rotary share
        with torch.device("meta"):  # names and shapes only
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        check_architecture(type(model).__name__, gguf_path)  # before the slow tensor load
        _write_weights(gguf_path, reader, model, out_dir)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        record_weight_types(gguf_path, out_dir)  # 4- or 8-bit layers: the engine names the --quantization for them
    # What model.save_pretrained writes beside the weights.
    config.dtype, config.architectures = "float32", [type(model).__name__]
    config.save_pretrained(out_dir)
    if model.can_generate():
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)  # tokenizer.json, tokenizer_config.json, chat_template.jinja


def _write_weights(gguf_path: Path, reader, model, out_dir: Path) -> None:
    """transformers' loader dequantizes every tensor of `reader.tensors`: it is handed one group of layers at a time
    (a layer's experts may be fused from several of its tensors, so layers stay whole), and each group's tensors,
    checked against the model's names and shapes, become one shard."""
    import torch
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    def mismatch(detail: str) -> ModelSourceError:
        return ModelSourceError(f"cannot convert {gguf_path}: weights do not match {type(model).__name__} ({detail})")

    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    every_tensor, groups = reader.tensors, layer_groups(reader.tensors, GROUP_BYTES)
    shard_names = ["model.safetensors"] if len(groups) == 1 else \
        [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]  # fmt: skip
    loaded: set[str] = set()
    total = 0  # bytes written
    weight_map: dict[str, str] = {}  # checkpoint name -> shard
    try:
        for group, shard in zip(groups, shard_names, strict=True):
            reader.tensors = group
            tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model,
                                           torch_dtype=torch.float32)["tensors"]  # fmt: skip
            for name, tensor in tensors.items():
                if name not in expected:
                    raise mismatch(f"unexpected {name}")
                if tuple(tensor.shape) != expected[name]:
                    raise mismatch(f"size mismatch for {name}: {tuple(tensor.shape)} in the file, {expected[name]} "
                                   "in its config")  # fmt: skip
            loaded |= tensors.keys()
            # Saved under the checkpoint's names, as save_pretrained does (a MoE layer's fused experts one by one)
            tensors = revert_weight_conversion(model, tensors)
            save_file(tensors, out_dir / shard, metadata={"format": "pt"})
            weight_map |= dict.fromkeys(tensors, shard)
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors  # before the next group is read
    finally:
        reader.tensors = every_tensor
    # Tied weights (lm_head = embed_tokens) are absent from the GGUF by design; anything else missing would silently
    # stay random, so refuse it.
    tie = getattr(model.config, "tie_word_embeddings", False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {}) if tie else set()
    missing = sorted(set(expected) - loaded - tied)
    if missing:
        raise mismatch(f"missing {missing[:3]}")
    if len(shard_names) > 1:  # the index transformers' from_pretrained reads a sharded checkpoint by
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def layer_groups(tensors: list, budget: int) -> list[list]:
    """The file's tensors in groups of whole layers (`blk.N.*`, in order, after the others: embeddings, output), each
    group at most `budget` bytes of float32 unless one layer alone is more."""
    layers: dict[int, list] = {}
    for tensor in tensors:
        parts = tensor.name.split(".")
        layers.setdefault(int(parts[1]) if parts[0] == "blk" else -1, []).append(tensor)
    groups: list[list] = []
    size = 0
    for _, layer in sorted(layers.items()):
        layer_bytes = sum(int(t.n_elements) * 4 for t in layer)
        if not groups or size + layer_bytes > budget:
            groups.append([])
            size = 0
        groups[-1] += layer
        size += layer_bytes
    return groups


@contextlib.contextmanager
def _converting(gguf_path: Path) -> Iterator[None]:
    """Any failure reading the file becomes one line naming it (the GGUF readers raise many types: ValueError,
    KeyError, OSError, ...)."""
    try:
        yield
    except ModelSourceError:
        raise
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSourceError(f"cannot convert {gguf_path}: {reason}") from exc
