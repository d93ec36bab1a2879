"""Sampler: greedy, filters, penalties, min_tokens, seeds and logprobs, on hand-made logits."""

from __future__ import annotations

import torch

from common.messages import EngineRequest, SamplingParams
from engine_core.request import Request
from engine_core.sampler import Sampler, _penalize

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


def test_logit_bias_forces_or_avoids_the_greedy_token() -> None:
    logits = [[0, 1.0, 5.0, 2.0, 0, 0, 0, 0]]
    (tok,), (lp,) = sample(logits, [req(SamplingParams(temperature=0, logit_bias={6: 100.0}, logprobs=0))])
    assert tok == 6
    # Logprobs stay those of the raw logits, before any processor.
    assert lp is not None and abs(lp.token_logprobs[0] - torch.log_softmax(torch.tensor(logits[0]), -1)[6]) < 1e-6
    (tok,), _ = sample(logits, [req(SamplingParams(temperature=0, logit_bias={2: -100.0}))])
    assert tok == 3
    # min_tokens' ban on EOS wins over a bias towards it.
    (tok,), _ = sample(logits, [req(SamplingParams(temperature=0, min_tokens=1, logit_bias={0: 100.0}))])
    assert tok == 2


def test_logit_bias_restricts_a_sampled_row() -> None:
    bias = {t: -100.0 for t in range(V) if t not in (2, 5)}
    params = SamplingParams(temperature=1.0, logit_bias=bias)
    draws = {sample([[1.0] * V], [req(params)], seed)[0][0] for seed in range(40)}
    assert draws == {2, 5}


def test_logit_bias_leaves_other_rows_alone() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, V).tolist()
    plain = [req(SamplingParams(temperature=0, logprobs=2)), req(SamplingParams(temperature=0.9, seed=3, logprobs=1))]
    biased = req(SamplingParams(temperature=0, logit_bias={t: -100.0 for t in range(V - 1)}))
    alone = sample(logits[:2], plain)
    tokens, logprobs = sample([logits[0], logits[2], logits[1]], [plain[0], biased, plain[1]])
    assert tokens[1] == V - 1
    assert [tokens[0], tokens[2]] == alone[0] and [logprobs[0], logprobs[2]] == alone[1]


def test_allowed_token_ids_hold_every_draw_and_the_stop_ban_holds_within_them() -> None:
    logits = [[9.0, 0, 3.0, 8.0, 1.0, 0, 0, 0]]
    (tok,), (lp,) = sample(logits, [req(SamplingParams(temperature=0, allowed_token_ids=[2, 4], logprobs=0))])
    assert tok == 2
    # Logprobs stay those of the raw logits, before any processor.
    assert lp is not None and abs(lp.token_logprobs[0] - torch.log_softmax(torch.tensor(logits[0]), -1)[2]) < 1e-6
    params = SamplingParams(temperature=1.0, allowed_token_ids=[1, 4, 6])
    assert {sample([[1.0] * V], [req(params)], seed)[0][0] for seed in range(40)} == {1, 4, 6}
    # EOS (0) allowed, but held back by min_tokens.
    (tok,), _ = sample(logits, [req(SamplingParams(temperature=0, min_tokens=1, allowed_token_ids=[0, 4]))])
    assert tok == 4


def test_bad_words_ban_a_words_last_token_after_the_rest_of_it() -> None:
    logits = [[0, 1.0, 5.0, 4.0, 3.0, 0, 0, 0]]
    words = [[6, 2], [7, 5, 3]]  # 2 after 6; 3 after 7, 5
    assert sample(logits, [req(SamplingParams(temperature=0, bad_words=words), outputs=[1, 6])])[0] == [3]
    assert sample(logits, [req(SamplingParams(temperature=0, bad_words=words), outputs=[6, 1])])[0] == [2]
    assert sample(logits, [req(SamplingParams(temperature=0, bad_words=[[2], [7, 5, 3]]), outputs=[7, 5])])[0] == [4]
    # The words follow outputs, not the prompt: the prompt ending in 6 bans nothing.
    assert sample(logits, [req(SamplingParams(temperature=0, bad_words=words), prompt=[1, 6])])[0] == [2]


def test_top_k_beyond_the_vocabulary_is_clamped() -> None:
    logits = [[4.0, 3.9, 3.8, 0, 0, 0, 0, 0]]
    for top_k in (10**6, 2**63):  # 2**63 does not fit an int64 tensor: the clamp keeps it out of one
        (tok,), _ = sample(logits, [req(SamplingParams(temperature=1.0, top_k=top_k, top_p=0.5))])
        assert tok in (0, 1)


def test_temperature_only_rows_draw_from_the_softmax() -> None:
    """The plain-sampling batch (no top-k/p, processors or logprobs) takes the compiled inverse-CDF sampler on
    CPU when it is built, else the torch race: either way the draws follow softmax(x / T), greedy rows inside
    the batch stay argmax, and bf16 logits are read in their own dtype."""
    row = [2.0, 1.0, 0.0, -1.0, 0.5, -30.0, 1.5, 0.0]
    n = 3000
    for dtype, temp in ((torch.float32, 1.0), (torch.bfloat16, 0.7)):
        logits = torch.tensor([row] * n, dtype=dtype)
        reqs = [req(SamplingParams(temperature=temp)) for _ in range(n - 1)] + [req(SamplingParams(temperature=0))]
        tokens, _ = Sampler(torch.device("cpu"), V, seed=3)(logits, reqs)
        assert tokens[-1] == 0  # the greedy row
        counts = torch.bincount(torch.tensor(tokens[:-1]), minlength=V).float() / (n - 1)
        expected = torch.softmax(logits[0].float() / temp, dim=-1)
        assert (counts - expected).abs().max() < 0.03, (counts, expected)
        assert counts[5] == 0  # e^-32 relative weight: never drawn


def test_temperature_only_seeded_rows_are_reproducible_on_a_large_vocabulary() -> None:
    vocab = 49152
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 3
    seeded = SamplingParams(temperature=1.0, seed=7)
    sampler = Sampler(torch.device("cpu"), vocab, seed=0)
    a, _ = sampler(logits, [req(seeded), req(SamplingParams()), req(SamplingParams()), req(SamplingParams())])
    b, _ = Sampler(torch.device("cpu"), vocab, seed=9)(logits[:1], [req(seeded)])
    assert a[0] == b[0] and all(0 <= t < vocab for t in a)


def test_a_seeded_row_draws_the_same_whatever_else_the_batch_asks_for() -> None:
    """Its own logprobs, a no-op top_k, or neighbours that need the filtered path once sent a seeded row down a
    different draw (the compiled sampler's inverse CDF against the exponential race)."""
    vocab = 49152
    sampler = Sampler(torch.device("cpu"), vocab, seed=0)
    logits = (torch.randn(2, vocab, generator=torch.Generator().manual_seed(1)) * 2).to(torch.bfloat16)
    plain = SamplingParams(temperature=0.9, seed=1234)
    variants = [
        (plain, SamplingParams(temperature=1.0)),
        (SamplingParams(temperature=0.9, seed=1234, logprobs=1), SamplingParams(temperature=1.0)),
        (SamplingParams(temperature=0.9, seed=1234, top_k=vocab), SamplingParams(temperature=1.0)),
        (SamplingParams(temperature=0.9, seed=1234, top_p=1.0), SamplingParams(temperature=1.0, top_p=0.5)),
        (plain, SamplingParams(temperature=1.0, repetition_penalty=1.3)),
        (plain, SamplingParams(temperature=0.0, logprobs=2)),
    ]
    for position in range(12):
        outputs = [5] * position
        alone, _ = sampler(logits[:1], [req(plain, outputs=outputs)])
        for params, neighbour in variants:
            tokens, _ = sampler(logits, [req(params, outputs=outputs), req(neighbour)])
            assert tokens[0] == alone[0], (position, params, neighbour)


def test_batched_penalties_match_their_definitions() -> None:
    """Repetition (transformers' own processor, over prompt and outputs), presence and frequency (OpenAI's formula,
    over outputs) on a batch that mixes rows with each, all three, and none, with repeated ids, ids at the edge of
    the vocabulary and past it, and requests whose tokens grow between calls (id buffers extended, then regrown)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    vocab = 50
    settings = [dict(repetition_penalty=1.3), dict(presence_penalty=0.7), dict(frequency_penalty=0.4),
                dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.1), dict(temperature=1.0),
                dict(repetition_penalty=1.2, frequency_penalty=0.3)]  # fmt: skip
    reqs = []
    for i, kw in enumerate(settings):
        # ids at the edge of the row, and past it (a tokenizer's ids beyond the model's vocabulary): never penalized
        prompt = torch.randint(0, vocab, (5 + 7 * i,), generator=gen).tolist() + [vocab - 1, vocab - 1, vocab + 3]
        outputs = torch.randint(0, 6, (3 * i,), generator=gen).tolist()  # few distinct ids: many repeats
        reqs.append(Request(EngineRequest(f"r{i}", prompt, SamplingParams(**kw), output_token_ids=outputs), i))
    for growth in (0, 5, 80):  # 80 more tokens outgrow the buffer the first call made
        for r in reqs:
            r.token_ids += torch.randint(0, vocab, (growth,), generator=gen).tolist()
        logits = torch.randn(len(reqs), vocab, generator=gen) * 3
        ours = logits.clone()
        _penalize(ours, reqs, [0] * len(reqs), None)
        for row, r in zip(range(len(reqs)), reqs, strict=True):
            p, want = r.params, logits[row : row + 1].clone()
            if p.repetition_penalty != 1.0:
                ids = torch.tensor([[t for t in r.token_ids if t < vocab]])
                want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, want)
            counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long), minlength=vocab)[:vocab]
            want = want - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
            assert torch.allclose(ours[row], want[0], atol=1e-5), (row, growth)
        assert all(r.token_array().tolist() == r.token_ids for r in reqs)


def test_a_token_in_flight_counts_as_the_last_output() -> None:
    """Overlapped steps (Sampler.sample_on_device) draw with each row's last token still on the device: the
    processors that run there (penalties, min_tokens, logit_bias, allowed_token_ids) count it as an output. The same
    tokens as the same requests with that token appended, greedy and seeded, with rows that have no token in flight
    beside them."""
    gen = torch.Generator().manual_seed(3)
    vocab = 40
    settings = [dict(temperature=0, repetition_penalty=2.0), dict(temperature=0, presence_penalty=2.0),
                dict(temperature=0, frequency_penalty=1.5), dict(temperature=0, min_tokens=3),
                dict(temperature=1.0, seed=5, repetition_penalty=1.5, frequency_penalty=0.5),
                dict(temperature=0, logit_bias={3: 2.0}, allowed_token_ids=[1, 2, 3, 4, 5]),
                dict(temperature=0.8, seed=9), dict(temperature=0)]  # fmt: skip
    flying = [9, 9, 9, 2, 9, 4, 0, 0]  # the token each row has in flight (none of its outputs yet); 0: none
    offsets = [1, 1, 1, 1, 1, 1, 0, 0]

    def make(with_flying: bool) -> list[Request]:
        reqs = []
        for i, kw in enumerate(settings):
            outputs = [7, 8, 7] if i < 3 else [1, 2]
            if with_flying and offsets[i]:
                outputs = [*outputs, flying[i]]
            reqs.append(Request(EngineRequest(f"r{i}", [5, 6, 7], SamplingParams(**kw), eos_token_ids=[2],
                                              output_token_ids=outputs), i))  # fmt: skip
        return reqs

    seen = 0
    for trial in range(20):
        logits = torch.randn(len(settings), vocab, generator=gen)
        logits[:3, 9] += 2.5  # the token in flight leads before its penalty
        logits[3, 2] += 4.0  # EOS leads: banned before min_tokens, which the token in flight reaches
        draw = Sampler(torch.device("cpu"), vocab, seed=trial).sample_on_device
        ours = draw(logits, make(False), offsets, torch.tensor(flying))[0]
        want = draw(logits, make(True), [0] * len(settings), None)[0]
        assert ours.tolist() == want.tolist(), trial
        blind = draw(logits, make(False), [0] * len(settings), None)[0]  # as if nothing were in flight
        seen += sum(a != b for a, b in zip(blind[:4].tolist(), ours[:4].tolist(), strict=True))
    assert seen > 25  # the token in flight changed 50 of these 80 draws
