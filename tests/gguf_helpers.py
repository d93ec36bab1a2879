"""Writing a GGUF as llama.cpp's converter does, for the tests that convert one (tests/test_gguf_*.py): the shape's
fields from the model's config, the architecture's own from the test; the tokenizer's copied from the default model's
GGUF; the tensors under the names of `gguf`'s own map. Each test ends with tests/engine_helpers.py's
assert_serves_hf_greedy: the converted model, served, gives the greedy tokens of the model the file was written
from."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import torch

from bench.gguf_convert import default_tokenizer_fields

VOCAB = 49152  # the default model's tokenizer, whose GGUF fields the files take


def write_gguf(path: Path, arch: gguf.MODEL_ARCH, config, fields: Callable[[gguf.GGUFWriter], None],
               tensors: dict[str, torch.Tensor], extra: dict[str, torch.Tensor] | None = None,
               tokenizer: bool = True) -> None:  # fmt: skip
    """`fields` adds the architecture's own fields; `tensors` are the HF model's (renamed here); `extra` go in under
    their own GGUF names; `tokenizer` False: no tokenizer (a file only its fields are read from)."""
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    fields(writer)
    for name, value, value_type, sub_type in default_tokenizer_fields() if tokenizer else []:
        writer.add_key_value(name, value, value_type, sub_type)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in tensors.items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), tensor.float().numpy())
    for name, tensor in (extra or {}).items():
        writer.add_tensor(name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_model(hf_class, config, norm: float = 1.0, std: float = 0.15):
    """transformers' `hf_class` of `config` with every weight drawn (seeded): norms around `norm` (Gemma's scale by
    1 + weight: 0), the rest N(0, std), large enough that the logits are O(1) and a wrong conversion shows."""
    torch.manual_seed(0)
    model = hf_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(norm + 0.1 * torch.randn_like(param) if "norm" in name else std * torch.randn_like(param))
    return model
