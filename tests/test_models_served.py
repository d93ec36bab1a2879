"""Models of each architecture served by the engine (chunked prefill, batched decode steps, the CPU kernels): the
greedy tokens of transformers' generate on the same random weights, saved as a checkpoint directory."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from common.config import EngineConfig
from engine_core.core import EngineCore
from engine_core.models.loader import build_model
from tests.engine_helpers import assert_serves_hf_greedy, greedy_request, run_engine, tokens_of
from tests.test_model_parity import MAX_POSITIONS, TINY_CONFIGS, VOCAB, random_prompts, tiny_hf_model


def test_a_saved_qwen3_serves_transformers_greedy_tokens(tmp_path) -> None:
    """A Qwen3 directory through the engine (the architecture check, the checkpoint's names, the q/k norms): the
    greedy tokens of transformers' generate, for prompts of different lengths in one batch."""
    hf = tiny_hf_model("qwen3")
    hf.save_pretrained(tmp_path)
    prompts = random_prompts([3, 17, 30], VOCAB, seed=2)
    core = EngineCore(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64, max_model_len=MAX_POSITIONS))
    requests = [greedy_request(f"q{i}", p, 12) for i, p in enumerate(prompts)]
    ours = tokens_of(run_engine(core, requests), [r.request_id for r in requests])
    with torch.inference_mode():
        refs = [hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(p) :]
                for p in prompts]  # fmt: skip
    assert ours == [r.tolist() for r in refs]


@pytest.mark.parametrize("arch", ["qwen2-window", "gemma3", "olmo3"])
def test_a_sliding_windows_model_serves_transformers_greedy_tokens_past_the_window(arch: str, tmp_path) -> None:
    """Through the engine (chunked prefill, decode steps, the CPU kernels up to the window and the masks past it):
    transformers' greedy tokens for prompts shorter and longer than a window of 8 on one of the two layers."""
    hf = tiny_hf_model(arch)
    assert sorted(hf.config.layer_types) == ["full_attention", "sliding_attention"]
    hf.save_pretrained(tmp_path)
    # Its explicit attention mask matters: generate would take Gemma's pad id (0) in a random prompt for padding.
    assert_serves_hf_greedy(tmp_path, hf, random_prompts([3, 17, 30], VOCAB, seed=4), max_num_batched_tokens=16)


@pytest.mark.parametrize("arch", ["granite", "granite4"])
def test_a_saved_granite_serves_transformers_greedy_tokens(arch: str, tmp_path) -> None:
    """Through the engine: Granite's checkpoint names (Granite 4.0's shared_mlp), tied embeddings and multipliers,
    in one batch of three."""
    hf = tiny_hf_model(arch)
    hf.save_pretrained(tmp_path)
    assert_serves_hf_greedy(tmp_path, hf, random_prompts([3, 17, 30], VOCAB, seed=3))


@pytest.mark.parametrize(("fields", "words"), [
    ({"layer_types": ["attention", "mamba"]}, "Mamba layers (its -H models) are not supported"),
    ({"num_local_experts": 4}, "mixture of experts is not supported"),
])  # fmt: skip
def test_granite4_models_with_mamba_layers_or_experts_are_refused(fields: dict, words: str) -> None:
    config = transformers.GraniteMoeHybridConfig(**{**TINY_CONFIGS["granite4"]().to_dict(), **fields})
    with pytest.raises(ValueError, match=re.escape(words)):
        build_model(config, torch.float32, torch.device("cpu"), MAX_POSITIONS)
