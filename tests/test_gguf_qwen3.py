"""A Qwen3 GGUF as llama.cpp writes one (Qwen3-0.6B to 8B are among the most shared GGUFs): its q and k norms, tied
embeddings and a head size of its own (`attention.key_length`, which transformers' GGUF loader leaves to the config's
default of 128) come through the conversion, and the server gives the model's own greedy tokens."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import transformers

from common.model_source import ModelSourceError, resolve_model
from tests.engine_helpers import assert_serves_hf_greedy
from tests.gguf_helpers import VOCAB, random_model, write_gguf

HEAD_DIM = 64  # not Qwen3's default of 128: only the file's field can say it


def tiny_qwen3() -> transformers.Qwen3ForCausalLM:
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                                      max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
                                      eos_token_id=2, architectures=["Qwen3ForCausalLM"])  # fmt: skip
    return random_model(transformers.Qwen3ForCausalLM, config)


def write_qwen3_gguf(model: transformers.Qwen3ForCausalLM, path: Path, head_dim: int = HEAD_DIM,
                     tokenizer: bool = True) -> None:  # fmt: skip
    def fields(writer: gguf.GGUFWriter) -> None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_freq_base(model.config.rope_parameters["rope_theta"])

    tensors = {name: t for name, t in model.state_dict().items() if name != "lm_head.weight"}  # tied
    write_gguf(path, gguf.MODEL_ARCH.QWEN3, model.config, fields, tensors, tokenizer=tokenizer)


def test_a_qwen3_gguf_serves_the_tokens_of_the_model_it_came_from(tmp_path: Path, monkeypatch) -> None:
    model, path = tiny_qwen3(), tmp_path / "qwen3-tiny.gguf"
    write_qwen3_gguf(model, path)
    parsed: list[Path] = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, file, *args, **kwargs) -> None:
            parsed.append(Path(file))
            super().__init__(file, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    resolved = resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert parsed == [path]  # config, weights, tokenizer, fields and weight types: one parse (common/gguf_parse.py)
    assert transformers.AutoConfig.from_pretrained(resolved.path).head_dim == HEAD_DIM
    assert_serves_hf_greedy(resolved.path, model, [[5, 900, 1200, 33] * 5, [300 + i for i in range(30)]])


def test_weights_of_other_shapes_than_the_fields_say_are_one_clear_error(tmp_path: Path) -> None:
    """Not a traceback from deep in torch: the server prints the reason and exits."""
    path = tmp_path / "odd.gguf"
    write_qwen3_gguf(tiny_qwen3(), path, head_dim=32, tokenizer=False)  # refused before the tokenizer is read
    with pytest.raises(ModelSourceError, match="weights do not match Qwen3ForCausalLM .size mismatch"):
        resolve_model(str(path), cache_dir=tmp_path / "cache")
