"""The pooling engine serving a classifier (--runner pooling): a request's result is its label logits, equal to
transformers' *ForSequenceClassification's; and a reranker trained as a causal LM (Qwen3-Reranker), given vLLM's
--hf-overrides, scores with the LM head rows of its "no" and "yes" tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from common.messages import EngineRequest, FinishReason, SamplingParams
from common.model_source import ModelSourceError, resolve_model
from engine_core.core import EngineCore
from tests.engine_helpers import fp32_config, run_engine
from tests.gguf_helpers import random_model

RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
            "is_original_qwen3_reranker": True}  # fmt: skip
PROMPTS = [[5, 7, 9, 11, 200], [3], list(range(40, 80)), [17, 4, 250, 6, 9, 31, 2, 8]]


def qwen3_config(vocab: int, **kw) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=128, **kw)  # fmt: skip


def pooled(core: EngineCore, prompts: list[list[int]]) -> list[np.ndarray]:
    requests = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=0), pool=True) for i, p in enumerate(prompts)]
    results = run_engine(core, requests)
    got = []
    for request in requests:
        (out,) = results[request.request_id]
        assert out.finish_reason == FinishReason.LENGTH and out.new_token_ids == [] and out.error is None
        assert out.pooled is not None
        got.append(np.frombuffer(out.pooled, dtype="<f4"))
    return got


@pytest.mark.parametrize("budget", [None, 16])  # one step for all, or the long prompt chunked
def test_a_sequence_classifier_gives_transformers_label_logits(tmp_path: Path, budget: int | None) -> None:
    model = random_model(transformers.Qwen3ForSequenceClassification, qwen3_config(300, num_labels=3))
    model.save_pretrained(tmp_path)
    core = EngineCore(fp32_config(model=str(tmp_path), max_num_batched_tokens=budget))
    assert core.config.runner == "pooling"  # chosen by itself: the checkpoint has a classifier's head, no LM head
    for prompt, logits in zip(PROMPTS, pooled(core, PROMPTS), strict=True):
        with torch.inference_mode():
            want = model(torch.tensor([prompt])).logits[0].numpy()
        assert logits.shape == (3,)
        np.testing.assert_allclose(logits, want, atol=2e-5, rtol=1e-4)


def write_causal_reranker(path: Path, tied: bool) -> tuple[transformers.Qwen3ForCausalLM, int, int]:
    """A random Qwen3 causal LM with the default model's tokenizer, saved as Qwen3-Reranker is; and the ids of the
    tokens "no" and "yes"."""
    tokenizer_dir = resolve_model(None).path
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    model = random_model(transformers.Qwen3ForCausalLM, qwen3_config(vocab, tie_word_embeddings=tied))
    model.save_pretrained(path)
    shutil.copy(tokenizer_dir / "tokenizer.json", path / "tokenizer.json")
    vocabulary = Tokenizer.from_file(str(path / "tokenizer.json"))
    return model, vocabulary.token_to_id("no"), vocabulary.token_to_id("yes")


@pytest.mark.parametrize("tied", [False, True])
def test_a_causal_reranker_scores_with_its_yes_and_no_rows(tmp_path: Path, tied: bool) -> None:
    model, no, yes = write_causal_reranker(tmp_path, tied)
    core = EngineCore(fp32_config(model=str(tmp_path), hf_overrides=json.dumps(RERANKER)))
    assert core.config.runner == "pooling"
    # The LM head's other rows are left unread: the head is one row, yes minus no
    assert [tuple(p.shape) for n, p in core.runner.model.named_parameters() if "lm_head" in n] == [(1, 64)]
    for prompt, score in zip(PROMPTS, pooled(core, PROMPTS), strict=True):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt])).logits[0, -1]
        np.testing.assert_allclose(score, [float(logits[yes] - logits[no])], atol=2e-5, rtol=1e-4)
    # Without is_original_qwen3_reranker, each token's row is a label of its own
    overrides = {**RERANKER, "is_original_qwen3_reranker": False}
    core = EngineCore(fp32_config(model=str(tmp_path), hf_overrides=json.dumps(overrides)))
    (both,) = pooled(core, PROMPTS[:1])
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPTS[0]])).logits[0, -1]
    np.testing.assert_allclose(both, [float(logits[no]), float(logits[yes])], atol=2e-5, rtol=1e-4)


def test_overrides_a_classifier_cannot_take_fail_at_start(tmp_path: Path) -> None:
    write_causal_reranker(tmp_path, tied=True)

    def start(overrides: dict, **kw) -> None:
        EngineCore(fp32_config(model=str(tmp_path), hf_overrides=json.dumps(overrides), **kw))

    with pytest.raises(ModelSourceError, match="'qqzxnotatoken' is not a token of this model's vocabulary"):
        start({**RERANKER, "classifier_from_token": ["no", "qqzxnotatoken"]})
    with pytest.raises(ModelSourceError, match="is_original_qwen3_reranker takes two classifier_from_token tokens"):
        start({**RERANKER, "classifier_from_token": ["no", "yes", "no"]})
    with pytest.raises(ModelSourceError, match="classifier_from_token needs a classifier's architecture"):
        start({"classifier_from_token": ["no", "yes"]}, runner="pooling")
    with pytest.raises(ModelSourceError, match="unsupported architecture 'BertForSequenceClassification'"):
        start({"architectures": ["BertForSequenceClassification"]})
    with pytest.raises(ModelSourceError, match="Qwen3ForSequenceClassification has no LM head, so it cannot generate"):
        start(RERANKER, runner="generate")
    with pytest.raises(ModelSourceError, match="--hf-overrides is not JSON"):
        EngineCore(fp32_config(model=str(tmp_path), hf_overrides="{architectures"))
