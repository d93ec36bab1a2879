"""Sampler logprobs: the chosen token's and the top n, the whole vocabulary, and vLLM's --logprobs-mode."""

from __future__ import annotations

import pytest
import torch

from common.messages import SamplingParams
from engine_core.sampler import Sampler
from tests.test_sampler import V, req, sample


def test_logprobs_of_chosen_and_top_n() -> None:
    logits = [[2.0, 1.0, 0, 0, 0, 0, 0, 0]]
    (tok,), (lp,) = sample(logits, [req(SamplingParams(temperature=0, logprobs=2))])
    expected = torch.log_softmax(torch.tensor(logits[0]), -1)
    assert tok == 0 and lp is not None
    assert abs(lp.token_logprobs[0] - expected[0].item()) < 1e-6
    assert lp.top_ids == [[0, 1]] and abs(lp.top_logprobs[0][1] - expected[1].item()) < 1e-6
    _, (none,) = sample(logits, [req(SamplingParams(temperature=0))])
    assert none is None


def test_logprobs_of_the_whole_vocabulary_beside_a_row_asking_for_one() -> None:
    """--max-logprobs -1 lets a request ask for every token's logprob (its `logprobs: -1`)."""
    logits = [[0.5, 3.0, -1.0, 2.0, 0, 1.5, -2.0, 0.25], [1.0, 0, 0, 0, 0, 0, 0, 4.0]]
    _, (full, one) = sample(logits, [req(SamplingParams(temperature=0, logprobs=V)),
                                     req(SamplingParams(temperature=0, logprobs=1))])  # fmt: skip
    expected = torch.log_softmax(torch.tensor(logits[0]), -1)
    assert full is not None and one is not None
    assert full.top_ids == [expected.argsort(descending=True).tolist()]  # every token, best first
    assert torch.allclose(torch.tensor(full.top_logprobs[0]), expected.sort(descending=True).values, atol=1e-6)
    assert one.top_ids == [[7]] and len(one.top_logprobs[0]) == 1


def test_logprobs_modes_report_the_model_or_the_distribution_drawn_from() -> None:
    """vLLM's --logprobs-mode: raw (the model's logits), or processed (after the processors, and a sampled row's
    temperature and filters, each dropped token at -inf); as log-softmax or as logits."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 0, 1.5, -2.0, 0.25]] * 2)
    biased = SamplingParams(temperature=0, logprobs=V, logit_bias={2: 5.0})  # greedy: processors only
    sampled = SamplingParams(temperature=0.5, top_k=3, seed=7, logprobs=V)
    rows = lambda: [req(biased), req(sampled)]  # noqa: E731

    def report(mode: str) -> tuple[list[int], list]:
        return Sampler(torch.device("cpu"), V, 0, mode)(logits.clone(), rows())

    tokens, (raw_lp, _) = report("raw_logprobs")
    assert tokens[0] == 2  # the bias chose it; raw logprobs still report the model's view of it
    assert raw_lp.token_logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[2].item(), abs=1e-6)
    assert report("raw_logits")[1][0].top_logprobs[0] == sorted(logits[0].tolist(), reverse=True)
    tokens, (greedy, drawn) = report("processed_logprobs")
    after_bias = logits[0].clone()
    after_bias[2] += 5.0
    assert greedy.top_ids[0][0] == 2
    assert greedy.token_logprobs[0] == pytest.approx(torch.log_softmax(after_bias, -1)[2].item(), abs=1e-6)
    top3 = torch.log_softmax(logits[1, [1, 3, 5]] / 0.5, -1)  # the three best, at temperature 0.5, renormalized
    assert drawn.top_ids[0][:3] == [1, 3, 5] and tokens[1] in (1, 3, 5)
    assert torch.allclose(torch.tensor(drawn.top_logprobs[0][:3]), top3, atol=1e-6)
    assert drawn.top_logprobs[0][3:] == [float("-inf")] * (V - 3)  # dropped by top_k
    assert drawn.token_logprobs[0] == pytest.approx(top3[[1, 3, 5].index(tokens[1])].item(), abs=1e-6)
    _, (_, scaled) = report("processed_logits")
    assert scaled.top_logprobs[0][:3] == pytest.approx([6.0, 4.0, 3.0]) and scaled.top_logprobs[0][3] == float("-inf")
