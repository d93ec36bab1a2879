"""Sampler: greedy, filters, penalties, min_tokens, seeds and logprobs, on hand-made logits."""

from __future__ import annotations

import torch

from common.messages import EngineRequest, SamplingParams
from engine_core.request import Request
from engine_core.sampler import Sampler

V = 8


def req(params: SamplingParams, prompt=(1, 2), outputs=()) -> Request:
    return Request(EngineRequest("r", list(prompt), params, eos_token_ids=[0], output_token_ids=list(outputs)), 0)


def sample(rows, reqs, seed=0):
    return Sampler(torch.device("cpu"), V, seed)(torch.tensor(rows, dtype=torch.float32), reqs)


def test_greedy_and_top_k_one() -> None:
    logits = [[0, 1, 5, 2, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 9]]
    tokens, _ = sample(logits, [req(SamplingParams(temperature=0)), req(SamplingParams(top_k=1))])
    assert tokens == [2, 7]


def test_top_k_top_p_min_p_restrict_the_draw() -> None:
    logits = [[4.0, 3.9, 3.8, 0, 0, 0, 0, 0]]
    for seed in range(30):
        (tok,), _ = sample(logits, [req(SamplingParams(temperature=1.0, top_k=2))], seed)
        assert tok in (0, 1)
        (tok,), _ = sample(logits, [req(SamplingParams(temperature=1.0, top_p=0.3))], seed)
        assert tok == 0  # the first token alone already holds 30% of the mass
        (tok,), _ = sample(logits, [req(SamplingParams(temperature=1.0, min_p=0.5))], seed)
        assert tok in (0, 1, 2)


def test_penalties() -> None:
    logits = [[0, 5.0, 4.9, 0, 0, 0, 0, 0]]
    # Token 1 was generated twice: frequency penalty pushes it below token 2.
    (tok,), _ = sample(logits, [req(SamplingParams(temperature=0, frequency_penalty=0.1), outputs=[1, 1])])
    assert tok == 2
    (tok,), _ = sample(logits, [req(SamplingParams(temperature=0, presence_penalty=0.2), outputs=[1])])
    assert tok == 2
    # Repetition penalty covers the prompt too.
    (tok,), _ = sample(logits, [req(SamplingParams(temperature=0, repetition_penalty=1.1), prompt=[1])])
    assert tok == 2


def test_min_tokens_holds_back_eos_and_stop_ids() -> None:
    logits = [[9.0, 0, 0, 8.0, 1.0, 0, 0, 0]]
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    (tok,), _ = sample(logits, [req(params, outputs=[5])])
    assert tok == 4
    (tok,), _ = sample(logits, [req(params, outputs=[5, 5])])
    assert tok == 0


def test_seed_depends_on_position_not_batch() -> None:
    logits = [[1.0] * V] * 3
    params = SamplingParams(temperature=1.0, seed=42)
    a, _ = sample(logits, [req(params, outputs=[4]), req(SamplingParams()), req(SamplingParams())], seed=1)
    b, _ = sample(logits[:1], [req(params, outputs=[4])], seed=2)
    assert a[0] == b[0]
    draws = {sample(logits[:1], [req(params, outputs=[4] * n)])[0][0] for n in range(20)}
    assert len(draws) > 1  # different positions draw differently


def test_logprobs_of_chosen_and_top_n() -> None:
    logits = [[2.0, 1.0, 0, 0, 0, 0, 0, 0]]
    (tok,), (lp,) = sample(logits, [req(SamplingParams(temperature=0, logprobs=2))])
    expected = torch.log_softmax(torch.tensor(logits[0]), -1)
    assert tok == 0 and lp is not None
    assert abs(lp.token_logprobs[0] - expected[0].item()) < 1e-6
    assert lp.top_ids == [[0, 1]] and abs(lp.top_logprobs[0][1] - expected[1].item()) < 1e-6
    _, (none,) = sample(logits, [req(SamplingParams(temperature=0))])
    assert none is None
