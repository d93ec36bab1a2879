"""Mixture-of-experts models (engine_core/models/moe.py): Qwen3-MoE (a dense layer beside a sparse one,
renormalized top-k), Qwen2-MoE (a shared expert behind a sigmoid gate, q/k/v biases, raw top-k weights), OLMoE (q
and k normed over all heads) and Mixtral (its own checkpoint names) give transformers' logits through the paged
cache and transformers' greedy tokens through the engine (on a GPU, through the grouped Triton kernels); in bf16 on
our CPU kernels a request's tokens do not depend on what runs beside it, and one C call for a layer's experts gives
the bits of the experts one by one.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from common.config import EngineConfig
from engine_core.core import EngineCore
from engine_core.models.loader import build_model, load_model
from engine_core.models.moe import ExpertsInC, MoeForCausalLM, SparseMoe
from engine_core.models.quant import prepare_linears
from tests.cpu_features import needs_int4_kernels, needs_int8_kernels, needs_linear_kernels
from tests.engine_helpers import assert_serves_hf_greedy, greedy_request, run_engine, tokens_of
from tests.lora_helpers import tiny_model_and_adapters
from tests.model_harness import PagedRun
from tests.test_model_parity import TOL, hf_logits, max_diff, prefill_then_decode, random_prompts, randomized

VOCAB, MAX_POSITIONS = 128, 128
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
MOE_CONFIGS = {
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SHAPE, head_dim=32, intermediate_size=96, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=True, mlp_only_layers=[0], architectures=["Qwen3MoeForCausalLM"])),
    "qwen2-moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **SHAPE, intermediate_size=96, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6,
        num_experts_per_tok=2, norm_topk_prob=False, architectures=["Qwen2MoeForCausalLM"])),
    "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(  # q and k normed over all heads
        **SHAPE, intermediate_size=24, num_experts=8, num_experts_per_tok=2, architectures=["OlmoeForCausalLM"])),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SHAPE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True,
        architectures=["MixtralForCausalLM"])),
}  # fmt: skip


def tiny_moe(arch: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return randomized(MOE_CONFIGS[arch]().eval())


@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def saved(request, tmp_path_factory):
    hf = tiny_moe(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path


def test_logits_equal_transformers_prefill_decode_and_chunks(saved):
    hf, path = saved
    ours = load_model(path, torch.float32, torch.device("cpu"), MAX_POSITIONS)
    assert isinstance(ours, MoeForCausalLM)
    sparse = [layer.mlp for layer in ours.layers if isinstance(layer.mlp, SparseMoe)]
    assert len(sparse) == (1 if hf.config.model_type == "qwen3_moe" else 2)  # Qwen3's layer 0 is dense
    prefill_diff, decode_diff = prefill_then_decode(ours, hf, random_prompts([5, 12, 1, 23], VOCAB), 4)
    assert prefill_diff < TOL and decode_diff < TOL
    prompts = random_prompts([19, 10], VOCAB, seed=2)
    run = PagedRun(ours, 2, 32)
    first = run.prefill([prompts[0][:7], prompts[1][:4]])
    second = run.prefill([prompts[0][7:], prompts[1][4:]])
    for prompt, a, b in zip(prompts, first, second, strict=True):
        assert max_diff(torch.cat([a, b]), hf_logits(hf, prompt)) < TOL
    # The test means something only if tokens spread over the experts and the top-k weights differ.
    experts, weights = sparse[0].route(torch.randn(64, hf.config.hidden_size))
    assert len(experts.unique()) == len(sparse[0].experts) and weights.std() > 0.01


def test_the_engine_serves_transformers_greedy_tokens(saved):
    """From the saved directory (the architecture check, each family's checkpoint names), prompts of different
    lengths in one batch, chunked by a small step budget."""
    hf, path = saved
    assert_serves_hf_greedy(path, hf, random_prompts([3, 17, 30], VOCAB, seed=5), 10, max_num_batched_tokens=16)


def test_bf16_tokens_do_not_depend_on_the_batch(saved):
    """bf16 on the CPU kernels: each prompt's greedy tokens alone equal its tokens among the others (an expert's
    rows are computed each alone, and a token sums its experts in one order whatever else chose them)."""
    _, path = saved
    prompts = random_prompts([4, 9, 21, 2, 14], VOCAB, seed=7)
    config = EngineConfig(model=str(path), dtype="bfloat16", num_kv_blocks=64, max_model_len=MAX_POSITIONS,
                          device="cpu")  # fmt: skip
    core = EngineCore(config)
    together = [greedy_request(f"b{i}", p, 12) for i, p in enumerate(prompts)]
    batched = tokens_of(run_engine(core, together), [r.request_id for r in together])
    alone = [tokens_of(run_engine(core, [greedy_request(f"a{i}", p, 12)]), [f"a{i}"])[0]
             for i, p in enumerate(prompts)]  # fmt: skip
    assert batched == alone


def test_lora_adapters_are_refused_at_start(tmp_path):
    """An expert runs a subset of the step's rows, whose adapters the LoRA wrappers could not tell apart: one clear
    error at start, not wrong answers."""
    tiny_moe("mixtral").save_pretrained(tmp_path / "moe")
    _, adapters = tiny_model_and_adapters(tmp_path)
    config = EngineConfig(model=str(tmp_path / "moe"), dtype="float32", num_kv_blocks=64, max_model_len=MAX_POSITIONS,
                          enable_lora=True, lora_modules=[f"qv={adapters['qv']}"])  # fmt: skip
    with pytest.raises(ValueError, match="LoRA adapters are not served on mixtures of experts"):
        EngineCore(config)


@needs_linear_kernels
@pytest.mark.parametrize("arch, quantization", [("qwen3-moe", "none"),
                                                pytest.param("mixtral", "int8", marks=needs_int8_kernels),
                                                pytest.param("mixtral", "int4", marks=needs_int4_kernels)])  # fmt: skip
def test_experts_in_one_c_call_equal_the_experts_one_by_one(arch: str, quantization: str, tmp_path) -> None:
    """csrc/moe.c runs a layer's experts in one call: the same bits as calling each expert's packed (or quantized)
    linears from Python, for a batch that leaves some experts without tokens."""
    tiny_moe(arch).save_pretrained(tmp_path)
    model = load_model(tmp_path, torch.bfloat16, torch.device("cpu"), MAX_POSITIONS)
    prepare_linears(model, quantization, torch.device("cpu"), torch.bfloat16)
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoe))
    for rows in (1, 3, 40):
        x = torch.randn(rows, model.config.hidden_size).bfloat16()
        moe._in_c = False
        in_c = moe(x)
        assert isinstance(moe._in_c, ExpertsInC) and moe._in_c.fmt == ["none", "int8", "int4"].index(quantization)
        moe._in_c = None  # the experts one by one
        assert torch.equal(in_c, moe(x))


def test_an_olmoe_with_clip_qkv_is_refused_at_start() -> None:
    """An OLMoE option the kernels do not apply: one clear error, not a model that answers otherwise."""
    config = transformers.OlmoeConfig(**SHAPE, intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                                      clip_qkv=8.0, architectures=["OlmoeForCausalLM"])  # fmt: skip
    with pytest.raises(ValueError, match="clip_qkv is not supported"):
        build_model(config, torch.float32, torch.device("cpu"), MAX_POSITIONS)
