"""Writing a GGUF as llama.cpp's converter does, for the tests that convert one (tests/test_gguf_*.py): the
architecture's fields are the test's; the tokenizer's are copied from the default model's GGUF; the tensors take the
names of `gguf`'s own map."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import torch

from tests.test_model_source import _default_gguf_path

VOCAB = 49152  # the default model's tokenizer, whose GGUF fields the files take


def write_gguf(path: Path, arch: gguf.MODEL_ARCH, fields: Callable[[gguf.GGUFWriter], None],
               tensors: dict[str, torch.Tensor], extra: dict[str, torch.Tensor] | None = None) -> None:  # fmt: skip
    """`fields` adds the architecture's fields; `tensors` are the HF model's (renamed here); `extra` go in under
    their own GGUF names."""
    num_layers = 1 + max(int(name.split(".")[2]) for name in tensors if name.startswith("model.layers."))
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    fields(writer)
    for field in gguf.GGUFReader(_default_gguf_path()).fields.values():
        if field.name.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    names = gguf.get_tensor_name_map(arch, num_layers)
    for name, tensor in tensors.items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), tensor.float().numpy())
    for name, tensor in (extra or {}).items():
        writer.add_tensor(name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
