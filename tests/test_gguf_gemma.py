"""A Gemma 3 GGUF, as llama.cpp writes one (the form gemma-3 models are most often shared in): converted once
through transformers and served with the greedy tokens of the HF model it was written from."""

from __future__ import annotations

from pathlib import Path

import gguf
import transformers

from common.model_source import resolve_model
from tests.engine_helpers import assert_serves_hf_greedy
from tests.gguf_helpers import VOCAB, random_model, write_gguf


def tiny_gemma3() -> transformers.Gemma3ForCausalLM:
    """Gemma 3's layout in small: five sliding layers of window 8 to one full one, heads of 32, a global rotary base
    of 1e6 scaled linearly by 8 as from the 4B up, and the local base of 1e4 (what a GGUF's fields and the config's
    defaults give back)."""
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, sliding_window=8, max_position_embeddings=512, query_pre_attn_scalar=256,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
        architectures=["Gemma3ForCausalLM"], bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    return random_model(transformers.Gemma3ForCausalLM, config, norm=0.0)


def write_gemma3_gguf(model: transformers.Gemma3ForCausalLM, path: Path) -> None:
    """What llama.cpp's converter writes for Gemma 3: its fields, norms stored as 1 + weight, q and k as they are."""
    c = model.config

    def fields(writer: gguf.GGUFWriter) -> None:
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
        writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
        writer.add_sliding_window(c.sliding_window)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)  # the global layers' (Gemma 3 4B and larger)
        writer.add_rope_scaling_factor(c.rope_parameters["full_attention"]["factor"])

    # lm_head is tied to the embeddings: the file has no copy of it
    tensors = {name: t.float() + 1 if name.endswith("norm.weight") else t
               for name, t in model.state_dict().items() if name != "lm_head.weight"}  # fmt: skip
    write_gguf(path, gguf.MODEL_ARCH.GEMMA3, c, fields, tensors)


def test_a_gemma3_gguf_serves_the_tokens_of_the_model_it_came_from(tmp_path: Path) -> None:
    """In fp32: the conversion's norms, names, rotary bases and windows all come back, token for token."""
    model = tiny_gemma3()
    path = tmp_path / "gemma3-tiny.gguf"
    write_gemma3_gguf(model, path)
    resolved = resolve_model(str(path), cache_dir=tmp_path / "cache")
    converted = transformers.AutoConfig.from_pretrained(resolved.path)
    assert converted.architectures == ["Gemma3ForCausalLM"]
    assert converted.rope_parameters == model.config.rope_parameters  # the global layers' scaling read back
    prompts = [[5, 900, 1200, 33], [7, 4000] * 9, [300 + i for i in range(20)]]  # past the window of 8
    assert_serves_hf_greedy(resolved.path, model, prompts)
