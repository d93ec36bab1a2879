"""A grammar after a reasoning model's thinking (StructuredOutput.reasoning_start / reasoning_end): the thinking is
sampled as without a grammar, the grammar holds everything after its end token, and an answer that does not open
the (optional) thinking is held from its first token. The default model has no <think> tokens: tokens of its own
greedy answer stand in for them."""

from __future__ import annotations

import json

import msgspec
import pytest

from common.messages import EngineRequest, FinishReason, SamplingParams, StructuredOutput
from engine_core.core import EngineCore
from tests.engine_helpers import drive, fp32_config, model_dir, run_engine, tokens_of
from tests.test_structured_engine import SCHEMA, chat_ids, text

PROMPT = "Describe a dog as JSON."


@pytest.fixture(scope="module")
def core():
    return EngineCore(fp32_config())


def greedy(rid: str, structured: StructuredOutput | None, outputs: list[int] | None = None) -> EngineRequest:
    params = SamplingParams(max_tokens=120, temperature=0.0, structured=structured)
    return EngineRequest(rid, chat_ids(PROMPT), params, output_token_ids=outputs or [])


def answer(core: EngineCore, req: EngineRequest) -> tuple[list[int], FinishReason | None]:
    out = run_engine(core, [req])[req.request_id]
    return tokens_of({"r": out}, ["r"])[0], out[-1].finish_reason


def schema(**thinking: int) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(SCHEMA), **thinking)


@pytest.fixture(scope="module")
def free(core: EngineCore) -> tuple[list[int], int]:
    """The unconstrained greedy answer, and the index of a token in it (not seen before it) to end the thinking."""
    tokens, _ = answer(core, greedy("free", None))
    end_at = next(k for k in range(4, len(tokens)) if tokens[k] not in tokens[:k])
    assert not text(tokens).lstrip().startswith("{")  # it does not answer in JSON by itself
    return tokens, end_at


def test_the_grammar_holds_only_what_follows_the_thinking(core, free) -> None:
    tokens, k = free
    got, reason = answer(core, greedy("think", schema(reasoning_end=tokens[k])))
    assert got[: k + 1] == tokens[: k + 1]  # the thinking, as without a grammar
    assert isinstance(json.loads(text(got[k + 1 :])), dict) and reason == FinishReason.STOP
    # An optional thinking that the answer opens (its first token is the start) is the same.
    opened, _ = answer(core, greedy("opened", schema(reasoning_start=tokens[0], reasoning_end=tokens[k])))
    assert opened == got
    # Resumed (an engine restart) while thinking, and after the grammar took over: the matcher replays the outputs.
    for cut in (2, k + 4):
        rest, reason = answer(core, greedy(f"resumed{cut}", schema(reasoning_end=tokens[k]), got[:cut]))
        assert got[:cut] + rest == got and reason == FinishReason.STOP


def test_an_answer_that_does_not_open_the_thinking_is_held_from_its_first_token(core, free) -> None:
    tokens, k = free
    held, _ = answer(core, greedy("held", schema()))
    assert held[0] != tokens[0] and text(held).lstrip().startswith("{")
    # The first token may be the grammar's or the thinking's start, which the model ranks below the grammar's here.
    never_first = tokens[k]
    got, reason = answer(core, greedy("open", schema(reasoning_start=never_first, reasoning_end=tokens[0])))
    assert got == held and reason == FinishReason.STOP


def test_thinking_before_a_grammar_keeps_the_overlap(free) -> None:
    """With --overlap-decode on, the rows that think and those the grammar holds give the synchronous tokens."""
    tokens, k = free
    reqs = [greedy("think", schema(reasoning_end=tokens[k])), greedy("held", schema()),
            greedy("open", schema(reasoning_start=tokens[0], reasoning_end=tokens[k]))]  # fmt: skip
    want, want_reasons, _, _ = drive("off", model_dir(), reqs)
    got, reasons, chained, _ = drive("on", model_dir(), reqs)
    assert chained > 20 and got == want and reasons == want_reasons
    assert got["think"][: k + 1] == tokens[: k + 1] and got["open"] == got["think"]


def test_the_thinking_tokens_travel_to_the_engine() -> None:
    so = schema(reasoning_start=5, reasoning_end=6)
    params = msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams(structured=so)), type=SamplingParams)
    assert params.structured == so and schema().reasoning_end is None
