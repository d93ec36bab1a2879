"""Constrained decoding inside the engine core: resume after a crash, preemption, compile errors, neighbours
untouched, and constraints that meet min_tokens or ignore_eos."""

from __future__ import annotations

import json

import pytest

from common.messages import EngineRequest, FinishReason, SamplingParams, StructuredOutput
from common.structured import INVALID_CONSTRAINT
from engine_core.core import EngineCore
from tests.engine_helpers import (
    counting_calls,
    drive,
    fp32_config,
    greedy_request,
    mixed_prompts,
    model_dir,
    run_engine,
    tokenizer,
    tokens_of,
)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 4}},
          "required": ["name", "tags"]}  # fmt: skip
JSON = StructuredOutput("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def core():
    return EngineCore(fp32_config())


def chat_ids(text: str) -> list[int]:
    ids = tokenizer().apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return ids if isinstance(ids, list) else ids["input_ids"]


def sampled(rid: str, seed: int, structured: StructuredOutput | None = JSON, outputs: list[int] | None = None,
            **kw) -> EngineRequest:  # fmt: skip
    params = SamplingParams(**{"max_tokens": 120, "temperature": 1.0, "seed": seed, "structured": structured, **kw})
    return EngineRequest(rid, chat_ids("Describe a dog as JSON."), params, output_token_ids=outputs or [])


def text(tokens: list[int]) -> str:
    return tokenizer().decode(tokens, skip_special_tokens=True)


def test_resumed_request_continues_inside_the_grammar(core: EngineCore):
    full = run_engine(core, [sampled("whole", 7)])["whole"]
    tokens = tokens_of({"whole": full}, ["whole"])[0]
    assert full[-1].finish_reason == FinishReason.STOP
    assert isinstance(json.loads(text(tokens)), dict)
    cut = len(tokens) // 2
    assert 0 < cut < len(tokens) - 1
    # A restarted engine gets the tokens already streamed: the matcher replays them, and the seeded draw
    # (a function of seed and position) continues exactly as before.
    resumed = run_engine(core, [sampled("resumed", 7, outputs=tokens[:cut])])["resumed"]
    assert tokens[:cut] + tokens_of({"r": resumed}, ["r"])[0] == tokens
    assert resumed[-1].finish_reason == FinishReason.STOP


def test_resumed_outputs_outside_the_grammar_fail_only_that_request(core: EngineCore):
    bad = tokenizer()("hello", add_special_tokens=False)["input_ids"]  # JSON must start with "{"
    results = run_engine(core, [sampled("bad", 1, outputs=bad), sampled("good", 2)])
    assert results["bad"][-1].finish_reason == FinishReason.ERROR and "grammar" in results["bad"][-1].error
    assert json.loads(text(tokens_of(results, ["good"])[0]))["name"] is not None


def test_compile_error_fails_only_its_request(core: EngineCore):
    broken = StructuredOutput("regex", "a(b")
    unknown = StructuredOutput("xml", "<a/>")
    # Builds, but xgrammar 0.2.8's compile fails on it (the API refuses it first; the engine must not 500 on it).
    uncompilable = StructuredOutput("json_schema", json.dumps({"type": "string", "pattern": "a{129}"}))
    results = run_engine(core, [sampled("broken", 1, broken), sampled("unknown", 1, unknown),
                                sampled("uncompilable", 1, uncompilable), sampled("ok", 3)])  # fmt: skip
    for rid in ("broken", "unknown", "uncompilable"):
        out = results[rid]
        assert len(out) == 1 and out[0].finish_reason == FinishReason.ERROR and out[0].new_token_ids == []
        assert "could not be compiled" in out[0].error
        assert out[0].error_code == INVALID_CONSTRAINT  # the API answers it as the request's 400
    assert "parenthesis" in results["broken"][0].error
    assert results["ok"][-1].finish_reason == FinishReason.STOP


def test_a_grammar_without_text_fails_its_request_as_the_requests_fault(core: EngineCore):
    nothing = StructuredOutput("json_schema", json.dumps({"$ref": "#"}))  # compiles, and matches no text
    dead_end = StructuredOutput("grammar", 'root ::= "a" x\nx ::= x "b"')  # "a", then no token at all
    results = run_engine(core, [sampled("nothing", 1, nothing), sampled("dead", 1, dead_end), sampled("ok", 3)])
    out = results["nothing"]
    assert len(out) == 1 and out[0].finish_reason == FinishReason.ERROR and out[0].new_token_ids == []
    assert out[0].error_code == INVALID_CONSTRAINT and "matches no text" in out[0].error  # a 400, not a 500
    dead = results["dead"]
    assert dead[-1].finish_reason == FinishReason.ERROR and dead[-1].error_code == INVALID_CONSTRAINT
    assert "allows no token" in dead[-1].error and text(tokens_of(results, ["dead"])[0]).startswith("a")
    assert results["ok"][-1].finish_reason == FinishReason.STOP


def test_unconstrained_neighbours_are_unaffected(core: EngineCore):
    prompts = mixed_prompts()[:6]
    plain = [greedy_request(f"p{i}", p, 12) for i, p in enumerate(prompts)]
    alone = tokens_of(run_engine(core, plain), [r.request_id for r in plain])
    mixed = [greedy_request(f"m{i}", p, 12) for i, p in enumerate(prompts)]
    constrained = [sampled(f"c{i}", i) for i in range(4)]
    # Constrained requests interleaved with the plain ones, in the same steps.
    together = run_engine(core, [r for pair in zip(mixed, constrained + [None] * 2, strict=True) for r in pair if r])
    assert tokens_of(together, [r.request_id for r in mixed]) == alone
    for r in constrained:
        assert json.loads(text(tokens_of(together, [r.request_id])[0]))


def test_grammar_ends_the_request_despite_ignore_eos_and_min_tokens(core: EngineCore):
    choice = StructuredOutput("choice", json.dumps(["yes", "no"]))
    reqs = [sampled("min", 1, choice, min_tokens=20), sampled("ign", 2, choice, ignore_eos=True),
            sampled("lp", 3, choice, logprobs=2)]  # fmt: skip
    results = run_engine(core, reqs)
    for r in reqs:
        out = results[r.request_id]
        assert text(tokens_of(results, [r.request_id])[0]) in ("yes", "no"), out
        assert out[-1].finish_reason == FinishReason.STOP
    assert all(o.new_logprobs is not None for o in results["lp"])


def test_the_grammar_wins_over_processors_that_ban_everything_it_allows(core: EngineCore):
    """allowed_token_ids and bad_words that leave no token the grammar allows: the row falls back to the model's
    own logits under the grammar's mask (engine_core/structured.apply_masks), so the request still answers inside
    the grammar instead of drawing from nothing."""
    choice = StructuredOutput("choice", json.dumps(["yes", "no"]))
    hello = tokenizer()("hello", add_special_tokens=False)["input_ids"]
    firsts = [tokenizer()(w, add_special_tokens=False)["input_ids"][0] for w in ("yes", "no")]
    reqs = [sampled("allowed", 4, choice, allowed_token_ids=hello), sampled("bad", 5, choice,
                                                                           bad_words=[[t] for t in firsts])]
    results = run_engine(core, reqs)
    for r in reqs:
        assert text(tokens_of(results, [r.request_id])[0]) in ("yes", "no"), results[r.request_id]
        assert results[r.request_id][-1].finish_reason == FinishReason.STOP


def test_a_huge_temperature_draws_inside_the_grammar(core: EngineCore):
    """Any finite temperature passes the checks; past float32's range (or from 1e30 in the compiled sampler) the
    masked tokens used to get weight, and the matcher refused the draw: an error mid-stream."""
    reqs = [sampled(f"t{i}", i, StructuredOutput("choice", json.dumps(["yes", "no"])), temperature=t)
            for i, t in enumerate([1e30, 3.5e38, 1e308])]  # fmt: skip
    results = run_engine(core, reqs)
    for r in reqs:
        assert text(tokens_of(results, [r.request_id])[0]) in ("yes", "no"), results[r.request_id]
        assert results[r.request_id][-1].finish_reason == FinishReason.STOP


def test_preempted_requests_keep_their_grammar_state():
    core = EngineCore(fp32_config(num_kv_blocks=24, block_size=16, max_model_len=384))  # too few blocks for 8 at once
    reqs = [sampled(f"r{i}", i) for i in range(8)]
    results = run_engine(core, reqs)
    assert core.scheduler.num_preempted > 0
    for r in reqs:
        assert results[r.request_id][-1].finish_reason == FinishReason.STOP
        assert json.loads(text(tokens_of(results, [r.request_id])[0]))["tags"] is not None


def test_overlapped_steps_sample_constrained_rows_after_the_update():
    """With --overlap-decode on (CUDA's default), a constrained row that follows a token in flight is launched with
    its logits only and sampled once the update has fed that token to its matcher (engine_core/overlap.py): the
    tokens and finish reasons are the synchronous engine's, beside unconstrained requests, a constraint that fails
    to compile while steps are in flight, and a KV pool small enough to preempt."""
    choice = StructuredOutput("choice", json.dumps(["yes", "no", "maybe"]))
    broken = StructuredOutput("regex", "a(b")
    # The two greedy rows arrive together and end at 98 tokens, 7 blocks each of which 2 are their shared chat
    # prefix: 12 blocks that a pool of 10 cannot hold, so it preempts however short the sampled answers run on this
    # machine's arithmetic (CI's drew shorter answers and, with the greedy rows apart, never preempted).
    reqs = [sampled("c0", 0), greedy_request("g0", chat_ids("Name a colour."), 64),
            greedy_request("g1", chat_ids("Count to five."), 64), sampled("c1", 1, logprobs=2),
            sampled("choice", 2, choice), sampled("broken", 3, broken), sampled("c2", 2, min_tokens=8),
            sampled("c3", 3)]  # fmt: skip
    late = {"sample_late": 0}
    kw = {"num_kv_blocks": 10, "block_size": 16, "max_model_len": 160}
    want, want_reasons, _, _ = drive("off", model_dir(), reqs, **kw)
    prepare = counting_calls(late, "sample_late")
    tokens, reasons, chained, (preempted, _, _) = drive("on", model_dir(), reqs, prepare=prepare, **kw)
    assert chained > 25 and late["sample_late"] > 25 and preempted > 0, (chained, late, preempted)
    assert tokens == want and reasons == want_reasons
    assert reasons["broken"] == FinishReason.ERROR and reasons["c0"] == FinishReason.STOP
    assert json.loads(text(tokens["c0"]))["tags"] is not None and text(tokens["choice"]) in ("yes", "no", "maybe")
