"""What transformers' GGUF loader leaves out of a Phi-3 config, read back from the file's own fields and tensors, as
llama.cpp's converter writes them: the rotated share of each head (Phi-4-mini rotates 3/4), the sliding window, and
LongRoPE's factors (Phi-3.5-mini, Phi-4-mini). Without them the model would load and answer wrongly, in silence."""

from __future__ import annotations

from pathlib import Path

import gguf


def complete_phi3_config(gguf_path: Path, config) -> None:
    """Sets on `config` (a Phi3Config from transformers' GGUF loader) what the file says and the loader drops."""
    reader = gguf.GGUFReader(gguf_path)
    fields = {name: field.contents() for name, field in reader.fields.items() if name.startswith("phi3.")}
    head_dim = config.hidden_size // config.num_attention_heads
    params = dict(config.rope_parameters or {})
    params["partial_rotary_factor"] = fields.get("phi3.rope.dimension_count", head_dim) / head_dim
    window = fields.get("phi3.attention.sliding_window")
    config.sliding_window = window or None  # Phi-4's converter writes 0 for none
    factors = {t.name: t.data.tolist() for t in reader.tensors if t.name.startswith("rope_factors_")}
    if factors:
        original = fields["phi3.rope.scaling.original_context_length"]
        params.update(rope_type="longrope", long_factor=factors["rope_factors_long.weight"],
                      short_factor=factors["rope_factors_short.weight"],
                      original_max_position_embeddings=original)  # fmt: skip
        config.original_max_position_embeddings = original
    config.rope_parameters = params
