"""The pooling engine (--runner pooling): an embed request's result is its prompt's last final-norm hidden state,
equal to transformers' base model's, whatever the chunking, the batch beside it and the prefix cache; an engine
serves embed requests or generation, never both."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from common.messages import EngineRequest, FinishReason, SamplingParams
from common.model_source import ModelSourceError
from engine_core.core import EngineCore
from tests.engine_helpers import fp32_config, run_engine
from tests.gguf_helpers import random_model

VOCAB = 300
MAX_POSITIONS = 128
LENGTHS = [5, 12, 1, 23, 40, 64]


def tiny_qwen3_base() -> transformers.Qwen3Model:
    """A 2-layer random Qwen3 decoder without an LM head, as Qwen3-Embedding-style checkpoints are saved."""
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False)  # fmt: skip
    return random_model(transformers.Qwen3Model, config)


@pytest.fixture(scope="module")
def qwen3_base(tmp_path_factory: pytest.TempPathFactory) -> tuple[transformers.Qwen3Model, str]:
    model = tiny_qwen3_base()
    path = tmp_path_factory.mktemp("qwen3-base")
    model.save_pretrained(path)  # architectures ["Qwen3Model"], weights without the "model." prefix
    return model, str(path)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def embed_request(rid: str, prompt: list[int]) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=0), pool=True)


def hf_last_hidden(model: transformers.Qwen3Model, prompt: list[int]) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).last_hidden_state[0, -1].numpy()


def embeddings(core: EngineCore, batch: list[list[int]], tag: str) -> list[tuple[np.ndarray, int]]:
    """Each prompt's embedding and cached token count, from one output per request."""
    ids = [f"{tag}-{i}" for i in range(len(batch))]
    results = run_engine(core, [embed_request(rid, p) for rid, p in zip(ids, batch, strict=True)])
    got = []
    for rid in ids:
        (out,) = results[rid]
        assert out.finish_reason == FinishReason.LENGTH and out.new_token_ids == [] and out.error is None
        assert out.pooled is not None
        got.append((np.frombuffer(out.pooled, dtype="<f4"), out.num_cached_tokens))
    return got


# One step for all, or every prompt over 16 tokens chunked; and with the overlapped pipeline (CUDA's default), which
# must leave embed requests to synchronous steps.
@pytest.mark.parametrize(("budget", "overlap"), [(2048, "off"), (16, "off"), (16, "on")])
def test_embeddings_equal_the_base_models_last_hidden_state(qwen3_base, budget: int, overlap: str) -> None:
    model, path = qwen3_base
    core = EngineCore(fp32_config(model=path, max_num_batched_tokens=budget, block_size=4, overlap_decode=overlap))
    if core.pipeline is not None:  # pytest.fail is no Exception: the pipeline's fallback cannot swallow it
        core.runner.launch = lambda *_: pytest.fail("an embed request's step was launched")  # type: ignore[method-assign]
    assert core.pooling and core.ready_message().runner == "pooling"  # auto: a checkpoint without an LM head
    batch = prompts()
    first = embeddings(core, batch, "a")
    for (vector, _), prompt in zip(first, batch, strict=True):
        np.testing.assert_allclose(vector, hf_last_hidden(model, prompt), atol=2e-4, rtol=2e-4)
    # Again: every full block but the last position's comes from the prefix cache, and the result holds.
    again = embeddings(core, batch, "b")
    for (vector, cached), (before, _), n in zip(again, first, LENGTHS, strict=True):
        assert cached == (n - 1) // 4 * 4
        np.testing.assert_allclose(vector, before, atol=2e-4, rtol=2e-4)


def test_a_prompt_the_length_of_the_context_embeds(qwen3_base) -> None:
    model, path = qwen3_base
    core = EngineCore(fp32_config(model=path, max_model_len=32, block_size=4))
    prompt = prompts()[-1][:32]
    (vector, _), = embeddings(core, [prompt], "full")
    np.testing.assert_allclose(vector, hf_last_hidden(model, prompt), atol=2e-4, rtol=2e-4)
    results = run_engine(core, [embed_request("over", prompt + [1])])
    assert "maximum context length is 32" in (results["over"][0].error or "")


def test_a_pooling_engine_refuses_generation_and_a_generating_engine_refuses_embeddings(qwen3_base, tmp_path) -> None:
    _, path = qwen3_base
    pooling = EngineCore(fp32_config(model=path))
    generate = EngineRequest("gen", [1, 2, 3], SamplingParams(max_tokens=4))
    scoring = EngineRequest("tokens", [1, 2, 3], SamplingParams(max_tokens=2), pool=True)
    results = run_engine(pooling, [generate, scoring])
    assert results["gen"][0].error == "this engine serves embeddings and scores only (--runner pooling)"
    assert "generates nothing" in (results["tokens"][0].error or "")
    # A causal LM served as it is generates; its engine refuses embed requests.
    hf = transformers.Qwen3ForCausalLM(tiny_qwen3_base().config)
    hf.save_pretrained(tmp_path / "lm")
    core = EngineCore(fp32_config(model=str(tmp_path / "lm")))
    assert not core.pooling
    results = run_engine(core, [embed_request("e", [1, 2, 3])])
    assert results["e"][0].error == "embeddings and scores need an engine started with --runner pooling"


def test_a_causal_lm_served_for_embeddings_leaves_its_lm_head_unread(qwen3_base, tmp_path) -> None:
    model, _ = qwen3_base
    lm = transformers.Qwen3ForCausalLM(model.config)
    lm.model.load_state_dict(model.state_dict())
    lm.save_pretrained(tmp_path)  # with its lm_head.weight, untied
    core = EngineCore(fp32_config(model=str(tmp_path), runner="pooling"))
    assert not any("lm_head" in name for name, _ in core.runner.model.named_parameters())
    prompt = prompts()[3]
    (vector, _), = embeddings(core, [prompt], "lm")
    np.testing.assert_allclose(vector, hf_last_hidden(model, prompt), atol=2e-4, rtol=2e-4)


def test_a_headless_checkpoint_cannot_generate(qwen3_base) -> None:
    _, path = qwen3_base
    with pytest.raises(ModelSourceError, match="Qwen3Model has no LM head, so it cannot generate"):
        EngineCore(fp32_config(model=path, runner="generate"))
