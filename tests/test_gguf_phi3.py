"""A Phi-3 GGUF as llama.cpp writes one (Microsoft ships Phi-3 and Phi-4-mini so): what transformers' GGUF loader
drops (the rotated share of each head, the sliding window, LongRoPE's factors, common/gguf_fields.py) comes back
from the file, and the server gives the greedy tokens of the HF model it was written from."""

from __future__ import annotations

from pathlib import Path

import gguf
import torch
import transformers

from common.model_source import resolve_model
from tests.engine_helpers import assert_serves_hf_greedy
from tests.gguf_helpers import VOCAB, random_model, write_gguf

ORIGINAL = 32  # LongRoPE's original context; every prompt below passes it, so both sides take the long factors
HEAD_DIM, ROTATED = 16, 12  # Phi-4-mini rotates 3/4 of each head


def tiny_phi4_mini() -> transformers.Phi3ForCausalLM:
    """Phi-4-mini's layout in small (partial rotary, LongRoPE), with a sliding window of 24 as Phi-3-mini-4k has."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": ROTATED / HEAD_DIM,
            "short_factor": [1.0 + 0.3 * i for i in range(ROTATED // 2)],
            "long_factor": [2.0 + i for i in range(ROTATED // 2)]}  # fmt: skip
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=4 * HEAD_DIM, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=ORIGINAL,
        sliding_window=24, rope_parameters=rope, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        architectures=["Phi3ForCausalLM"],
    )  # fmt: skip
    return random_model(transformers.Phi3ForCausalLM, config)


def write_phi3_gguf(model: transformers.Phi3ForCausalLM, path: Path) -> None:
    """llama.cpp's fields for Phi-3: the rotated dims of a head, the original context, the window; LongRoPE's
    factors as two tensors of their own."""
    c, rope = model.config, model.config.rope_parameters

    def fields(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_orig_ctx_len(ORIGINAL)
        writer.add_rope_dimension_count(ROTATED)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_sliding_window(c.sliding_window)

    factors = {f"rope_factors_{kind}.weight": torch.tensor(rope[f"{kind}_factor"]) for kind in ("long", "short")}
    write_gguf(path, gguf.MODEL_ARCH.PHI3, c, fields, model.state_dict(), factors)


def test_a_phi3_gguf_serves_the_tokens_of_the_model_it_came_from(tmp_path: Path) -> None:
    """In fp32, past the original context and the window. Without the fields read back, the file still converts
    and loads, and answers wrongly: the config's checks below are what fail first."""
    model = tiny_phi4_mini()
    path = tmp_path / "phi4-mini-tiny.gguf"
    write_phi3_gguf(model, path)
    resolved = resolve_model(str(path), cache_dir=tmp_path / "cache")
    converted = transformers.AutoConfig.from_pretrained(resolved.path)
    assert converted.rope_parameters["partial_rotary_factor"] == ROTATED / HEAD_DIM
    assert (converted.rope_parameters["rope_type"], converted.sliding_window) == ("longrope", 24)
    prompts = [[5, 900, 1200, 33] * 9, [300 + i for i in range(40)]]
    assert_serves_hf_greedy(resolved.path, model, prompts)
