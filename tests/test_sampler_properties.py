"""Property: whatever settings pass the engine's checks, a draw never takes a token its processors masked
(allowed_token_ids, bad_words, min_tokens, or all of them at once), a greedy row takes the processed row's first
maximum, and a seeded row draws the same alone as in a batch; on the compiled sampler and on torch's path (CUDA's)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.messages import EngineRequest, SamplingParams
from engine_core.cpu_kernels import cpu_kernels
from engine_core.request import Request
from engine_core.request_checks import invalid_request
from engine_core.sampler import Sampler

VOCAB = 301  # odd: rows at unaligned addresses
EOS = 0
TOKEN = st.integers(0, VOCAB - 1)
# Each setting's bounds and the values next to them, and values far past any useful range that the checks accept.
TEMPERATURE = st.one_of(st.sampled_from([0.0, 1e-5, math.nextafter(1e-5, 1), 0.5, 1.0, 2.0, 100.0, 1e30, 3.5e38,
                                         1e308]), st.floats(0, 4, allow_subnormal=False))  # fmt: skip
PARAMS = st.builds(
    SamplingParams,
    temperature=TEMPERATURE,
    top_p=st.one_of(st.just(1.0), st.floats(1e-8, 1, allow_subnormal=False)),
    top_k=st.one_of(st.just(0), st.integers(1, VOCAB + 5)),
    min_p=st.one_of(st.just(0.0), st.floats(0, 1, allow_subnormal=False)),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    min_tokens=st.sampled_from([0, 0, 3]),
    stop_token_ids=st.lists(TOKEN, max_size=3),
    presence_penalty=st.sampled_from([0.0, -2.0, 2.0]),
    frequency_penalty=st.sampled_from([0.0, -2.0, 2.0]),
    repetition_penalty=st.sampled_from([1.0, 1e-6, 2.0]),
    logit_bias=st.dictionaries(TOKEN, st.sampled_from([-100.0, -1.5, 100.0]), max_size=4),
    allowed_token_ids=st.one_of(st.just([]), st.lists(TOKEN, min_size=1, max_size=6)),
    bad_words=st.lists(st.lists(TOKEN, min_size=1, max_size=2), max_size=3),
)
ROW = st.tuples(
    st.integers(0, 2**31), st.sampled_from([0.1, 3.0, 30.0]), st.sampled_from([torch.float32, torch.bfloat16])
)


def request(params: SamplingParams, i: int, outputs: list[int]) -> Request:
    msg = EngineRequest(f"r{i}", [5, 6, 7], params, eos_token_ids=[EOS], output_token_ids=outputs)
    assert invalid_request(msg, VOCAB, 4096, {}) is None, invalid_request(msg, VOCAB, 4096, {})
    return Request(msg, i)


@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_every_draw_respects_the_processors(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "torch":
        monkeypatch.setattr("engine_core.sampler.cpu_kernels", lambda: None)
    elif cpu_kernels() is None:
        pytest.skip("needs the compiled CPU kernels (a C compiler)")
    sampler = Sampler(torch.device("cpu"), VOCAB, seed=0)

    @settings(max_examples=300, derandomize=True, deadline=None, database=None)
    @given(st.lists(PARAMS, min_size=1, max_size=4), ROW, st.lists(TOKEN, max_size=3))
    def check(params: list[SamplingParams], row: tuple[int, float, torch.dtype], outputs: list[int]) -> None:
        seed, scale, dtype = row
        logits = (torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
        reqs = [request(p, i, outputs) for i, p in enumerate(params)]
        processed = sampler._process(logits, reqs, [0] * len(reqs), None).float()
        tokens, _ = sampler(logits, reqs)
        for i, (p, token, allowed) in enumerate(zip(params, tokens, processed, strict=True)):
            if torch.isneginf(allowed).all():
                continue  # every token masked (say, min_tokens banning the only allowed one): any pick is a choice
            assert not torch.isneginf(allowed[token]), (p, token)
            if p.greedy:
                assert token == int(allowed.argmax()), (p, token)
            if p.seed is not None:
                (alone,), _ = sampler(logits[i : i + 1], [reqs[i]])
                assert alone == token, (p, token, alone)

    check()
