"""A position is computed by the same kernel however it comes to be computed, so a request's tokens and, bit for
bit, its logprobs do not depend on the prefix cache, on preemption, or on an engine restart (Request.decoding).
The decode and prefill kernels sum a score's products in another order; with SmolLM2 in bf16 through the C
kernels (the production CPU path), computing a position in the other kernel moved its logprob by up to 0.08 and
changed the greedy text of some prompts. That happened to the lone prompt position a prefix-cache hit leaves
one token past a block boundary (it ran as a decode), and to every output position recomputed after a preemption
or a restart (they ran as prefill). Bit for bit where the prefill kernel runs (AVX512F or AVX2, tests/cpu_features.py).
"""

from __future__ import annotations

import pytest

from common.messages import EngineRequest, SamplingParams
from engine_core.batch import SchedulerOutput
from engine_core.core import EngineCore
from engine_core.request import Request
from tests.cpu_features import HAS_PREFILL
from tests.engine_helpers import engine_config, mixed_prompts, run_engine

BLOCK = 16
MAX_TOKENS = 24


def bf16_engine(**kw) -> EngineCore:
    return EngineCore(engine_config(dtype="bfloat16", block_size=BLOCK, kv_cache_memory=0.25, **kw))


def request(rid: str, prompt: list[int], streamed: list[int] | None = None) -> EngineRequest:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    return EngineRequest(rid, prompt, params, output_token_ids=streamed or [])


def tokens_and_logprobs(core: EngineCore, requests: list[EngineRequest], one_at_a_time: bool = False) -> list:
    """[(tokens, their logprobs, cached prompt tokens)] in request order."""
    runs = [run_engine(core, [r]) for r in requests] if one_at_a_time else [run_engine(core, requests)]
    outs = [run[r.request_id] for r in requests for run in runs if r.request_id in run]
    return [([t for o in out for t in o.new_token_ids],
             [x for o in out if o.new_logprobs for x in o.new_logprobs.token_logprobs],
             out[0].num_cached_tokens) for out in outs]  # fmt: skip


def corpus_prompts(lengths: list[int]) -> list[list[int]]:
    text = [t for p in mixed_prompts() for t in p]
    return [text[37 * i :][:n] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def undisturbed() -> tuple[list[list[int]], list]:
    prompts = corpus_prompts([BLOCK * 2 + 1, BLOCK * 5 + 1, 64, 82, 150, 203])
    requests = [request(f"u{i}", p) for i, p in enumerate(prompts)]
    return prompts, tokens_and_logprobs(bf16_engine(enable_prefix_caching=False), requests)


def test_a_prefix_cache_hit_gives_the_cold_runs_tokens_and_logprobs() -> None:
    """Each prompt twice, alone, so that only the cache differs: one token past a block boundary (one token left to
    compute after the hit) at three lengths; also a whole number of blocks (the last block is recomputed), and two
    past."""
    prompts = corpus_prompts([BLOCK * 2 + 1, BLOCK * 5 + 1, BLOCK * 9 + 1, 64, 82])
    core = bf16_engine()
    cold = tokens_and_logprobs(core, [request(f"c{i}", p) for i, p in enumerate(prompts)], one_at_a_time=True)
    warm = tokens_and_logprobs(core, [request(f"w{i}", p) for i, p in enumerate(prompts)], one_at_a_time=True)
    for prompt, (tokens, logprobs, cached), (warm_tokens, warm_logprobs, warm_cached) in zip(prompts, cold, warm,
                                                                                              strict=True):  # fmt: skip
        n = len(prompt)
        assert cached == 0
        assert warm_cached == (n - 1) // BLOCK * BLOCK, f"{n} tokens: the hit should cover every full block"
        if HAS_PREFILL:
            assert (warm_tokens, warm_logprobs) == (tokens, logprobs), f"{n} tokens, {warm_cached} from the cache"
        else:  # torch's prefill (no kernel) sums one query row in another order than a chunk of many: bf16's
            # rounding then moves a logprob (by 0.11 at most on 2026-11-26), a wrong hit would move the tokens
            drift = max(abs(a - b) for a, b in zip(warm_logprobs, logprobs, strict=True))
            assert warm_tokens == tokens and drift < 0.25, (n, drift)


def test_a_prompt_holding_an_earlier_answer_gives_the_cold_runs_tokens_and_logprobs() -> None:
    """A chat's next turn: the prompt is the first turn's prompt, its answer, then more. The answer's K/V in the
    cache came from decode rows, and this prompt's positions run as prefill, so only the blocks wholly inside the
    first prompt may hit (before the fix the answer's blocks hit too and the logprobs moved)."""
    first, more = corpus_prompts([BLOCK * 2 + 5, 20])
    core = bf16_engine()
    (answer, _, _), = tokens_and_logprobs(core, [request("turn1", first)])
    turn2 = first + answer + more
    warm = tokens_and_logprobs(core, [request("warm", turn2)])
    core.kv.reset_prefix_cache()
    cold = tokens_and_logprobs(core, [request("cold", turn2)])
    assert cold[0][2] == 0 and warm[0][2] == BLOCK * 2
    assert warm[0][:2] == cold[0][:2]


def test_a_resumed_request_goes_on_exactly_as_undisturbed(undisturbed) -> None:
    """What a restarted engine does with the streams it resumes: prompt and streamed outputs recomputed."""
    prompts, reference = undisturbed
    streamed = [tokens[: 5 + 3 * i] for i, (tokens, _, _) in enumerate(reference)]
    requests = [request(f"r{i}", p, s) for i, (p, s) in enumerate(zip(prompts, streamed, strict=True))]
    resumed = tokens_and_logprobs(bf16_engine(), requests)
    for done, (tokens, logprobs, _), (rest, rest_logprobs, _) in zip(streamed, reference, resumed, strict=True):
        assert (rest, rest_logprobs) == (tokens[len(done) :], logprobs[len(done) :])


def test_preempted_requests_go_on_exactly_as_undisturbed(undisturbed) -> None:
    prompts, reference = undisturbed
    # 24 blocks of 16: about two of these requests at a time; the rest are preempted and recomputed.
    core = bf16_engine(num_kv_blocks=24, max_model_len=384, enable_prefix_caching=False)
    ours = tokens_and_logprobs(core, [request(f"p{i}", p) for i, p in enumerate(prompts)])
    assert core.scheduler.num_preempted > 0
    assert [(t, lp) for t, lp, _ in ours] == [(t, lp) for t, lp, _ in reference]


def test_a_chunk_is_all_prompt_or_all_outputs_and_runs_as_prefill_or_decode_rows() -> None:
    prompt = EngineRequest("p", list(range(40)), SamplingParams(max_tokens=8), output_token_ids=[5, 6, 7])
    recomputing = Request(prompt, 0)  # a resumed request: 40 prompt tokens, 3 outputs streamed before
    assert recomputing.next_chunk(budget=100, computed=32) == 8  # the rest of the prompt, not the outputs
    assert recomputing.next_chunk(budget=5, computed=32) == 5
    assert recomputing.next_chunk(budget=100, computed=40) == 3
    last_prompt_token = Request(EngineRequest("q", list(range(40)), SamplingParams(max_tokens=8)), 1)
    last_prompt_token.num_computed_tokens = 39  # 32 from the prefix cache, then a chunk budget that ended at 39
    recomputing.num_computed_tokens = 40
    out = SchedulerOutput()
    out.add(last_prompt_token, 1)
    out.add(recomputing, 3)
    out.put_decodes_first()
    assert out.requests == [recomputing, last_prompt_token] and out.sample == [True, True]
    for req in out.requests:
        req.block_ids = [0, 1, 2]
    _, positions, meta, sample_rows = bf16_engine().runner._prepare(out)
    assert meta.num_decodes == 3 and meta.decode_seq_lens is not None
    assert meta.decode_seq_lens.tolist() == [41, 42, 43]  # each output row attends up to its own position
    assert [(c.start, c.num_tokens, c.context_len) for c in meta.prefills] == [(3, 1, 40)]
    assert positions[:4].tolist() == [40, 41, 42, 39] and sample_rows == [2, 3]
