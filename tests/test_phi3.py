"""Phi-3's departures from the Llama checkpoint (Phi3ForCausalLM): LongRoPE past the original context, and q/k/v and
gate/up fused in the checkpoint, which tensor parallelism slices part by part and LoRA adapters name as they are. The
plain parity checks are tests/test_model_parity.py's (its "phi3" model)."""

from __future__ import annotations

import pytest
import torch
import transformers

from bench.make_random_lora import ALL_FUSED, write_adapter
from engine_core import distributed
from engine_core.core import EngineCore
from engine_core.models.loader import build_model, load_weights
from tests.engine_helpers import assert_matches_hf, fp32_config, hf_greedy, run_engine, tokens_of
from tests.lora_helpers import lora_request, merged, refs
from tests.test_model_parity import (
    CPU,
    LLAMA_LIKE,
    MAX_POSITIONS,
    PHI3_LONGROPE,
    TOL,
    VOCAB,
    prefill_then_decode,
    random_prompts,
)

ORIGINAL = 16  # the pretrained context; every prompt below passes it


def tiny_phi3(original: int = ORIGINAL) -> transformers.Phi3ForCausalLM:
    torch.manual_seed(0)
    config = transformers.Phi3Config(**LLAMA_LIKE, **PHI3_LONGROPE, original_max_position_embeddings=original)
    model = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param))
    return model


def test_longrope_past_the_original_context_uses_the_long_factors() -> None:
    """A server whose context passes the original length rotates with the long factors from position 0, as vLLM
    does (transformers switches per forward, so one whole-sequence forward past the original length is the
    reference); with the short factors the logits move by far more than the tolerance."""
    hf = tiny_phi3()
    ours = build_model(hf.config, torch.float32, CPU, MAX_POSITIONS)
    load_weights(ours, hf.state_dict())
    prompts = random_prompts([20, 37, ORIGINAL + 1], VOCAB)
    assert max(prefill_then_decode(ours, hf, prompts, 4)) < TOL
    short = build_model(hf.config, torch.float32, CPU, ORIGINAL)  # a context that cannot pass it: short factors
    assert not torch.equal(short.rotary.cos, ours.rotary.cos[:ORIGINAL])


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_weights_split_over_two_ranks_as_separate_ones_do(rank: int, monkeypatch) -> None:
    """Rank `rank` of two gets the same q/k/v and gate/up rows from Phi-3's fused weights as a Llama of the same
    shape gets from the separate ones."""
    hf = tiny_phi3()
    fused = hf.state_dict()
    num_q, num_kv = 4 * 16, 2 * 16  # heads x head_dim
    separate = {}
    for key, tensor in fused.items():
        if ".qkv_proj." in key:
            for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.split([num_q, num_kv, num_kv]), strict=True):
                separate[key.replace("qkv_proj", part)] = t
        elif ".gate_up_proj." in key:
            for part, t in zip(("gate_proj", "up_proj"), tensor.chunk(2), strict=True):
                separate[key.replace("gate_up_proj", part)] = t
        else:
            separate[key] = tensor
    llama = transformers.LlamaConfig(**LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2,
                                     architectures=["LlamaForCausalLM"])  # fmt: skip
    group = distributed.TPGroup(rank, 2, rank, CPU, torch.float32)
    monkeypatch.setattr(distributed, "_group", group)
    ours, reference = build_model(hf.config, torch.float32, CPU, 64), build_model(llama, torch.float32, CPU, 64)
    load_weights(ours, fused)
    load_weights(reference, separate)
    theirs = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(param, theirs[name]), name
    assert ours.layers[0].self_attn.qkv_proj.weight.shape[0] == (num_q + 2 * num_kv) // 2  # a real split


def test_an_adapter_of_the_fused_layers_answers_as_its_merged_weights(tmp_path) -> None:
    """An engine serving a Phi-3 directory, with an adapter on qkv_proj, o_proj, gate_up_proj and down_proj (the
    names Phi-3's adapters use): base and adapter rows side by side each give transformers' greedy tokens, the
    adapter's with it merged into the weights. (Contexts within the original length: short factors on both sides.)"""
    hf = tiny_phi3(original=MAX_POSITIONS)
    hf.save_pretrained(tmp_path / "phi3")
    adapter = write_adapter(tmp_path / "fused", hf.config, ALL_FUSED, rank=8, alpha=16, seed=1, std=0.2)
    config = fp32_config(model=str(tmp_path / "phi3"), enable_lora=True, lora_modules=[f"fused={adapter}"],
                         max_model_len=MAX_POSITIONS)  # fmt: skip
    prompts = random_prompts([3, 9, 24, 40], VOCAB, seed=2)
    lora = refs(config)["fused"]
    requests = [lora_request(f"{kind}-{i}", p, lora if kind == "fused" else None, max_tokens=10)
                for i, p in enumerate(prompts) for kind in ("base", "fused")]  # fmt: skip
    results = run_engine(EngineCore(config), requests, stagger=2)
    ours = {kind: tokens_of(results, [f"{kind}-{i}" for i in range(len(prompts))]) for kind in ("base", "fused")}
    assert_matches_hf(ours["base"], hf_greedy(prompts, 10, hf), max_flips=0)
    assert_matches_hf(ours["fused"], hf_greedy(prompts, 10, merged(hf, adapter)), max_flips=0)
    assert ours["fused"] != ours["base"]
