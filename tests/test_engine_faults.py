"""A request that makes a step raise fails alone; the engine re-checks every sampling parameter it receives."""

from __future__ import annotations

import pytest
import torch

from common import ipc
from common.messages import EngineRequest, FinishReason, Logprobs, SamplingParams, StructuredOutput
from engine_core.core import EngineCore
from engine_core.request import Request
from engine_core.sampler import Sampler
from tests.engine_helpers import fp32_config, greedy_request, mixed_prompts, run_engine, tokens_of

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def core():
    # A small step budget: longer prompts are chunked, so batches mix decodes, chunks and finishing prefills.
    return EngineCore(fp32_config(max_num_batched_tokens=96))


class HostileSampler:
    """Raises for any batch holding the hostile request once it has `fail_after` outputs, as top_k = 2**63 did
    (the overflow came from the sampler's tensor build)."""

    def __init__(self, inner: Sampler, fail_after: int) -> None:
        self.inner = inner
        self.fail_after = fail_after
        self.raised_with_others = 0

    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 offsets: list[int] | None = None) -> tuple[list[int], list[Logprobs | None]]:  # fmt: skip
        if any(r.request_id == "hostile" and r.num_output_tokens >= self.fail_after for r in requests):
            self.raised_with_others += len(requests) > 1
            raise ValueError("Overflow when unpacking long long")
        return self.inner(logits, requests, offsets)


def undisturbed(core: EngineCore, requests: list[EngineRequest], stagger: int = 0) -> list[list[int]]:
    core.kv.reset_prefix_cache()  # both runs compute every prompt themselves
    return tokens_of(run_engine(core, requests, stagger), [r.request_id for r in requests])


@pytest.mark.parametrize("fail_after", [0, 3])  # at its first sampled step, or mid-decode with KV blocks held
def test_a_raising_request_fails_alone(core: EngineCore, fail_after: int, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = mixed_prompts()
    good = [greedy_request(f"g{i}", prompts[i], MAX_TOKENS) for i in range(8)]
    expected = undisturbed(core, good, stagger=3)
    hostile = greedy_request("hostile", prompts[9], MAX_TOKENS)
    # What it streams before it starts to raise: greedy, so the first tokens of a run alone.
    streams_first = undisturbed(core, [greedy_request("alone", prompts[9], MAX_TOKENS)])[0][:fail_after]
    sampler = HostileSampler(core.runner.sampler, fail_after)
    monkeypatch.setattr(core.runner, "sampler", sampler)
    core.kv.reset_prefix_cache()
    # run_engine checks the KV cache's ref counts after every step and that no block is left in use.
    results = run_engine(core, [*good[:4], hostile, *good[4:]], stagger=3)
    assert sampler.raised_with_others > 0  # the hostile request did share failing batches
    *streamed, last = results["hostile"]
    assert [t for out in streamed for t in out.new_token_ids] == streams_first
    assert last.finish_reason == FinishReason.ERROR and last.error and "Overflow" in last.error
    assert tokens_of(results, [r.request_id for r in good]) == expected
    for r in good:
        assert results[r.request_id][-1].finish_reason == FinishReason.LENGTH


def test_engine_rejects_what_the_frontend_should_have(core: EngineCore) -> None:
    vocab = core.vocab_size
    bad = {
        "top_k-2**63": SamplingParams(temperature=0.8, top_k=2**63),  # the probe's request
        "top_k-2**40": SamplingParams(temperature=0.8, top_k=2**40),
        "temperature-inf": SamplingParams(temperature=float("inf")),
        "top_p-nan": SamplingParams(top_p=float("nan")),
        "repetition-tiny": SamplingParams(repetition_penalty=1e-300),
        "presence-big": SamplingParams(presence_penalty=2.5),
        "bias-key": SamplingParams(logit_bias={vocab: 1.0}),
        "bias-negative-key": SamplingParams(logit_bias={-1: 1.0}),
        "bias-value": SamplingParams(logit_bias={5: 1e9}),
        "bias-many": SamplingParams(logit_bias={t: 1.0 for t in range(1025)}),
        "stop-id": SamplingParams(stop_token_ids=[vocab]),
        "seed": SamplingParams(seed=2**63),
        "min-tokens": SamplingParams(min_tokens=-1),
        "logprobs": SamplingParams(logprobs=21),  # past --max-logprobs (20)
        "prompt-logprobs": SamplingParams(prompt_logprobs=21),
        "think-end": SamplingParams(structured=StructuredOutput("json_object", reasoning_end=vocab)),
    }
    prompt = mixed_prompts()[2]
    clamped = SamplingParams(max_tokens=MAX_TOKENS, top_k=10**6, seed=1, ignore_eos=True)  # valid, beyond the vocab
    ok = [
        greedy_request("greedy", prompt, MAX_TOKENS),
        EngineRequest("top_k-huge", prompt, clamped),
        EngineRequest("biased", prompt, SamplingParams(max_tokens=3, temperature=0, logit_bias={42: 100.0})),
    ]
    expected = undisturbed(core, ok)
    # Through the wire codec first, as the engine process receives them: every one of them decodes.
    sent = [ipc.decode_input(ipc.encode(EngineRequest(rid, prompt, p))) for rid, p in bad.items()]
    results = run_engine(core, [*sent[:6], *ok, *sent[6:]])
    for rid in bad:
        (out,) = results[rid]
        assert out.finish_reason == FinishReason.ERROR and out.error and "out of range" in out.error, rid
    assert tokens_of(results, [r.request_id for r in ok]) == expected
    assert expected[2] == [42] * 3
    assert len(expected[1]) == MAX_TOKENS
