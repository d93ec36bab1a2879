"""Rope scaling in GGUFs as llama.cpp writes it, which transformers' GGUF loader drops and the conversion reads back
(common/gguf_fields.py) rather than serve a model that answers wrongly: Llama 3's (Llama 3.2 1B and 3B are the most
shared GGUFs) as a `rope_freqs` tensor of per-frequency divisors, refused when they are not Llama 3's; linear and
YaRN scaling as `rope.scaling.*` fields (Gemma 3's linear scaling is served in tests/test_gguf_gemma.py)."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import pytest
import torch
import transformers

from common.gguf_fields import complete_config
from common.model_source import resolve_model
from tests.engine_helpers import assert_serves_hf_greedy
from tests.gguf_helpers import VOCAB, random_model, write_gguf

HEAD_DIM, THETA = 16, 10000.0
SCALING = {"rope_type": "llama3", "rope_theta": THETA, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}  # fmt: skip


def tiny_llama3() -> transformers.LlamaForCausalLM:
    """Heads of 16 with base 1e4: of the 8 frequencies, the slowest is divided by the factor and the next one
    smoothed, as Llama 3's longest wavelengths are."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=4 * HEAD_DIM, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=131072, rope_parameters=SCALING, bos_token_id=1,
                                      eos_token_id=2, architectures=["LlamaForCausalLM"])  # fmt: skip
    return random_model(transformers.LlamaForCausalLM, config, std=0.3)


def rope_freqs(scaling: dict) -> torch.Tensor:
    """llama.cpp's per-frequency divisors for Llama 3's scaling."""
    original = scaling["original_max_position_embeddings"]
    low, high = original / scaling["low_freq_factor"], original / scaling["high_freq_factor"]  # wavelengths
    divisors = []
    for freq in (1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))).tolist():
        wavelen = 2 * math.pi / freq
        smooth = (original / wavelen - scaling["low_freq_factor"]) / (
            scaling["high_freq_factor"] - scaling["low_freq_factor"])  # fmt: skip
        divisors.append(1.0 if wavelen < high else scaling["factor"] if wavelen > low
                        else 1 / ((1 - smooth) / scaling["factor"] + smooth))  # fmt: skip
    return torch.tensor(divisors)


def write_llama3_gguf(model: transformers.LlamaForCausalLM, path: Path, divisors: torch.Tensor) -> None:
    """llama.cpp's fields for Llama, q and k rows permuted as its converter does, and the rope_freqs tensor."""
    c = model.config

    def fields(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_dimension_count(HEAD_DIM)
        writer.add_rope_freq_base(THETA)

    def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    tensors = {}
    for name, t in model.state_dict().items():
        heads = c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads if ".k_proj." in name else 0
        tensors[name] = permute(t, heads) if heads else t
    write_gguf(path, gguf.MODEL_ARCH.LLAMA, c, fields, tensors, {"rope_freqs.weight": divisors})


def test_a_llama3_gguf_keeps_its_rope_scaling(tmp_path: Path) -> None:
    model = tiny_llama3()
    divisors = rope_freqs(SCALING)
    assert divisors[-1] == 8.0 and 1.0 < divisors[-2] < 8.0 and divisors[-3] == 1.0  # each regime present
    path = tmp_path / "llama3-tiny.gguf"
    write_llama3_gguf(model, path, divisors)
    resolved = resolve_model(str(path), cache_dir=tmp_path / "cache")
    rope = transformers.AutoConfig.from_pretrained(resolved.path).rope_parameters
    assert {k: rope[k] for k in SCALING} == SCALING
    prompts = [[5, 900, 1200, 33] * 9, [300 + i for i in range(60)]]
    assert_serves_hf_greedy(resolved.path, model, prompts)


def test_rope_freqs_that_are_not_llama3s_are_refused(tmp_path: Path) -> None:
    """Divisors of another scaling (Llama 3's with another high-frequency factor) are not guessed at."""
    model, path = tiny_llama3(), tmp_path / "odd.gguf"
    write_llama3_gguf(model, path, rope_freqs({**SCALING, "high_freq_factor": 2.0}))
    config = transformers.LlamaConfig(**{**model.config.to_dict(), "rope_parameters": {"rope_theta": THETA}})
    with pytest.raises(ValueError, match="not Llama 3's rope scaling"):
        complete_config(path, config)


@pytest.mark.parametrize(("kind", "expected"), [
    ("linear", {"rope_type": "linear", "factor": 4.0}),
    ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    ("longrope", None),  # only Phi-3's, whose factors are tensors of their own
])  # fmt: skip
def test_rope_scaling_fields_are_read_back(kind: str, expected: dict | None, tmp_path: Path) -> None:
    model, path = tiny_llama3(), tmp_path / f"{kind}.gguf"
    config = transformers.LlamaConfig(**{**model.config.to_dict(), "rope_parameters": {"rope_theta": THETA}})

    def fields(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(32768)

    write_gguf(path, gguf.MODEL_ARCH.LLAMA, config, fields, {}, tokenizer=False)
    if expected is None:
        with pytest.raises(ValueError, match="not one this conversion reads"):
            complete_config(path, config)
        return
    complete_config(path, config)
    assert config.rope_parameters == {"rope_theta": THETA, **expected}
