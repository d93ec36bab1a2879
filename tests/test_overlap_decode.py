"""Overlapped steps (engine_core/overlap.py): with --overlap-decode on, an engine produces the same tokens and finish
reasons as without, step by step holds its KV invariant, and leaks nothing, through stops while the next step is in
flight, aborts, length limits, preemption, prompts chunked over launched steps, recomputes, and bad_words sampled
after the update of the step before. On the CPU a launch runs at once, so these tests check the bookkeeping; the
overlap itself pays on CUDA (bench/gpu.py)."""

from __future__ import annotations

import msgspec
import pytest

from common.messages import EngineRequest, SamplingParams
from engine_core.core import EngineCore
from tests.engine_helpers import counting_calls, drive, engine_config, run_engine, save_tiny_llama, tokens_of

STOPS = list(range(40, 70))  # frequent enough in a random model's output that many requests stop early


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-overlap"), max_positions=1024, init=0.2)


def requests(n: int, stops: bool = True, **extra) -> list[EngineRequest]:
    """Greedy and seeded sampled requests (both reproducible whatever the batch), some with stop ids."""
    out = []
    for i in range(n):
        stop_ids = STOPS if stops and i % 3 == 0 else []
        params = SamplingParams(max_tokens=4 + 5 * i, temperature=0.0 if i % 2 else 0.9, top_p=0.95, seed=i,
                                stop_token_ids=stop_ids, ignore_eos=True, **extra)  # fmt: skip
        out.append(EngineRequest(f"r{i}", [(7 * j + i) % 250 + 4 for j in range(6 + 9 * i)], params))
    return out


def test_same_tokens_and_finishes_as_synchronous_steps(tiny_dir) -> None:
    reqs = requests(14)
    sync_tokens, sync_reasons, _, _ = drive("off", tiny_dir, reqs)
    tokens, reasons, chained, _ = drive("on", tiny_dir, reqs)
    assert chained > 20  # the overlap was taken, step after step
    assert tokens == sync_tokens and reasons == sync_reasons
    assert any(len(t) < r.params.max_tokens for t, r in zip(tokens.values(), reqs, strict=True))  # stops happened


def test_requests_admitted_while_a_step_is_in_flight(tiny_dir) -> None:
    """A request that arrives while a step is in flight joins the next launched step, prefix-cache hits included,
    with the synchronous engine's tokens and finish reasons."""
    shared = [(5 * j) % 250 + 4 for j in range(32)]  # eight blocks of 4: later prompts hit the prefix cache
    reqs = [EngineRequest(r.request_id, shared + r.prompt_token_ids, r.params) for r in requests(12)]
    configs = (({"block_size": 4}, 8), ({"block_size": 4, "max_num_batched_tokens": 64}, 1),
               ({"block_size": 4, "max_num_seqs": 3}, 6))  # seats freed by finished requests are taken  # fmt: skip
    for kw, fewest in configs:
        sync_tokens, sync_reasons, _, _ = drive("off", tiny_dir, reqs, **kw)
        tokens, reasons, chained, (_, _, admitted) = drive("on", tiny_dir, reqs, **kw)
        assert chained > 10 and admitted >= fewest, (kw, chained, admitted)
        assert tokens == sync_tokens and reasons == sync_reasons, kw


def test_length_limits_preemption_and_aborts(tiny_dir) -> None:
    """A context limit that cuts requests, a KV cache too small for all of them (the lookahead cannot allocate:
    the synchronous path preempts), and aborts of requests that are in flight. No stop ids: lengths, and so the
    preemption, do not depend on the numbers a device computes."""
    reqs = requests(10, stops=False)
    kw = {"max_model_len": 64, "num_kv_blocks": 18, "block_size": 4}
    aborts = {9: "r1", 14: "r4", 21: "r5"}
    sync_tokens, sync_reasons, _, _ = drive("off", tiny_dir, reqs, aborts, **kw)
    tokens, reasons, chained, (preempted, aborted_in_flight, _) = drive("on", tiny_dir, reqs, aborts, **kw)
    assert chained > 5 and preempted > 0 and aborted_in_flight > 0
    for rid, want in sync_tokens.items():
        if rid in aborts.values():  # stopped where it was: an overlapped engine answers a step later
            assert want[: len(tokens[rid])] == tokens[rid] or tokens[rid][: len(want)] == want, rid
        else:
            assert tokens[rid] == want and reasons[rid] == sync_reasons[rid], rid


def test_bad_words_read_the_token_in_flight_once_its_update_is_done(tiny_dir) -> None:
    """bad_words ban a token after the outputs that end a word's head, which the host must know: a step whose row
    follows a token in flight is launched with its logits only and sampled after the update of the step before
    (ModelRunner.sample_late). Each request bans a bigram of its own output without the ban, so the ban changes it;
    the tokens are the synchronous engine's, with the overlap taken."""
    unbanned = requests(8, stops=False)
    free_tokens = drive("off", tiny_dir, unbanned)[0]
    reqs = []
    for r in unbanned:
        out = free_tokens[r.request_id]
        words = [out[k : k + 2] for k in range(2, len(out) - 1, 6)]
        reqs.append(EngineRequest(r.request_id, r.prompt_token_ids, msgspec.structs.replace(r.params, bad_words=words)))
    sync_tokens, sync_reasons, _, _ = drive("off", tiny_dir, reqs)
    late = {"sample_late": 0}
    tokens, reasons, chained, _ = drive("on", tiny_dir, reqs, prepare=counting_calls(late, "sample_late"))
    assert chained > 20 and late["sample_late"] > 20, (chained, late)
    assert tokens == sync_tokens and reasons == sync_reasons
    changed = [rid for rid, t in tokens.items() if len(free_tokens[rid]) > 3 and t != free_tokens[rid]]
    assert len(changed) == sum(len(t) > 3 for t in free_tokens.values())


def test_logprobs_are_read_back_with_the_tokens(tiny_dir) -> None:
    """Logprobs come back with the tokens of the step in flight: the synchronous engine's tokens, logprobs and
    alternatives, beside requests that ask for none or for other counts, with the overlap taken."""
    counts = [None, 0, 3]
    reqs = [EngineRequest(r.request_id, r.prompt_token_ids, msgspec.structs.replace(r.params, logprobs=counts[i % 3]))
            for i, r in enumerate(requests(9))]  # fmt: skip
    sync_lp: dict = {}
    ours_lp: dict = {}
    sync_tokens, sync_reasons, _, _ = drive("off", tiny_dir, reqs, logprobs=sync_lp)
    tokens, reasons, chained, _ = drive("on", tiny_dir, reqs, logprobs=ours_lp)
    assert chained > 20
    assert tokens == sync_tokens and reasons == sync_reasons
    for rid, want in sync_lp.items():
        got = ours_lp[rid]
        assert [lp is None for lp in got] == [lp is None for lp in want], rid
        for a, b in zip(got, want, strict=True):
            if b is not None:
                assert a.top_ids == b.top_ids and len(b.top_ids[0]) == reqs[int(rid[1:])].params.logprobs, rid
                assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4), rid  # GPUs: batch rounding
                assert [v for row in a.top_logprobs for v in row] == pytest.approx(
                    [v for row in b.top_logprobs for v in row], abs=1e-4), rid


def test_prompts_longer_than_the_budget_are_chunked_in_launched_steps(tiny_dir) -> None:
    """Prompts of 18 to 315 tokens under budgets of 32 and 64: each chunk after the first is launched while the one
    before is in flight, starting past it, beside the decodes, its tokens from the host; the last one is sampled and
    feeds the request's first decode row. No step runs synchronously, and the tokens and finish reasons are the
    synchronous engine's."""
    reqs = [EngineRequest(r.request_id, r.prompt_token_ids * 3, r.params) for r in requests(12)]
    assert max(len(r.prompt_token_ids) for r in reqs) > 4 * 64
    for kw in ({"max_num_batched_tokens": 32}, {"max_num_batched_tokens": 64, "max_num_seqs": 4}):
        sync_tokens, sync_reasons, _, _ = drive("off", tiny_dir, reqs, block_size=4, **kw)
        counts = {"execute": 0}
        tokens, reasons, chained, _ = drive("on", tiny_dir, reqs, prepare=counting_calls(counts, "execute"),
                                            block_size=4, **kw)  # fmt: skip
        assert counts["execute"] == 0 and chained > 100, (kw, counts, chained)
        assert tokens == sync_tokens and reasons == sync_reasons, kw


def test_preempted_and_resumed_requests_are_recomputed_in_launched_steps(tiny_dir) -> None:
    """A request with outputs already (preempted, or resumed after an engine restart) computes its prompt and then its
    outputs in separate chunks, in launched steps like any other. Memory that runs short sends the lookahead back to
    the synchronous scheduler, which preempts; the step it schedules is launched too. The tokens are the synchronous
    engine's, no step executes synchronously, and no launch fails (drive checks)."""
    prompt = lambda i: [(7 * j + i) % 250 + 4 for j in range(8)]  # noqa: E731
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    reqs = [EngineRequest(f"r{i}", prompt(i), greedy(n)) for i, n in enumerate((20, 40, 40, 10))]
    reqs.insert(2, EngineRequest("resumed", prompt(9), greedy(24), output_token_ids=[31, 32, 33, 34, 35, 36]))
    launches = 0
    for num_kv_blocks in (12, 16, 20):
        kw = {"max_model_len": 48, "num_kv_blocks": num_kv_blocks, "block_size": 4}
        sync_tokens, sync_reasons, _, _ = drive("off", tiny_dir, reqs, **kw)
        counts = {"execute": 0}
        prepare = counting_calls(counts, "execute")
        tokens, reasons, chained, (preempted, _, _) = drive("on", tiny_dir, reqs, prepare=prepare, **kw)
        assert preempted > 0 and counts["execute"] == 0, (num_kv_blocks, counts)
        assert tokens == sync_tokens and reasons == sync_reasons, num_kv_blocks
        launches += chained
    assert launches > 185  # 196; 177 when such requests were left to synchronous steps


def test_a_request_whose_cached_prefix_reaches_past_its_prompt_starts_with_decode_rows(tiny_dir) -> None:
    """A resumed request whose prompt and first outputs are all in the prefix cache computes only its last outputs,
    as decode rows. Admitted into a launched step after a fresh prompt, it goes before it: decode rows come first.
    It goes on as the request that cached them did, and as in the synchronous engine."""
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    prompt = [(7 * j) % 250 + 4 for j in range(8)]
    results = {}
    for mode in ("off", "on"):
        config = engine_config(model=tiny_dir, dtype="float32", block_size=4, overlap_decode=mode)
        core = EngineCore(config)
        first = tokens_of(run_engine(core, [EngineRequest("first", prompt, greedy(20))]), ["first"])[0]
        core.add_request(EngineRequest("running", [9, 8, 7, 6, 5], greedy(30)))
        early = [t for _ in range(2) for out in core.step() for t in out.new_token_ids]  # the overlap is in flight
        resumed = EngineRequest("resumed", prompt, greedy(20), output_token_ids=first[:12])
        outs = run_engine(core, [EngineRequest("fresh", [11, 12, 13], greedy(6)), resumed])
        results[mode] = dict(zip(outs, tokens_of(outs, list(outs)), strict=True))
        results[mode]["running"][:0] = early
        if core.runner.device.type == "cpu":  # batch-invariant kernels: the same tokens beside other requests
            assert results[mode]["resumed"] == first[12:], mode
        assert core.kv.pool.num_free == core.kv.num_blocks
        if mode == "on":
            assert core.scheduler.prefix_hits == 16  # the resumed request's prompt and first outputs
    assert results["on"] == results["off"]


def test_penalties_min_tokens_and_biases_run_beside_a_token_in_flight(tiny_dir) -> None:
    """Their processors count the token in flight as the request's last output, reading it on the device: the
    synchronous engine's tokens and finish reasons, with the overlap taken. The penalties are strong enough that a
    history missing its last token changes what is drawn."""
    settings = ({"repetition_penalty": 1.8}, {"presence_penalty": 1.5, "frequency_penalty": 1.0},
                {"min_tokens": 12}, {"logit_bias": {5: 3.0, 77: -100.0}, "repetition_penalty": 0.7})  # fmt: skip
    for extra in settings:
        reqs = requests(10, **extra)
        sync_tokens, sync_reasons, _, _ = drive("off", tiny_dir, reqs)
        tokens, reasons, chained, _ = drive("on", tiny_dir, reqs)
        assert chained > 20, extra
        assert tokens == sync_tokens and reasons == sync_reasons, extra
