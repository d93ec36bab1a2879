"""--reasoning-parser on fixed model outputs: the qwen3 and deepseek_r1 rules split <think> reasoning from content
(whole, and streams split at every position), in front of a tool-call parser, as OpenAI-shaped deltas and messages;
answers that a grammar holds whole are not split, and grammars wait for the thinking where its tags are tokens;
usage counts the thinking's tokens."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.messages import StructuredOutput
from frontend.text.tokenizer import Tokenizer
from frontend.tools.reasoning import (
    END,
    START,
    ReasoningParser,
    ReasoningTokens,
    after_thinking,
    thinking_tokens,
    with_reasoning,
)
from frontend.tools.tool_parsers import HermesParser, Reasoning
from frontend.tools.tool_stream import ToolStreams, message
from tests.engine_helpers import model_dir
from tests.test_api_thinking import tagged_model
from tests.test_tool_parsers import events_of, splits

Result = tuple[str, str, list[tuple[str, str]]]  # reasoning, content, [(name, arguments)]


def run(rule: str, pieces: list[str], tools: bool = False) -> Result:
    parser = ReasoningParser(rule, HermesParser() if tools else None)
    events, content, calls = events_of(parser, pieces)
    assert parser.calls == len(calls)
    return "".join(e.text for e in events if isinstance(e, Reasoning)), content, calls


def same_everywhere(rule: str, text: str, tools: bool = False) -> Result:
    """The text whole, one character at a time, and cut in two at every position: one result."""
    results = {repr(run(rule, pieces, tools)) for pieces in splits(text)}
    assert len(results) == 1, results
    return run(rule, [text], tools)


CASES = [
    # (rule, model output, reasoning, content)
    ("qwen3", "<think>\nThe capital.\n</think>\n\nParis.", "\nThe capital.\n", "Paris."),
    ("qwen3", "  <think>a</think>b </think> c", "a", "b </think> c"),
    ("qwen3", "Paris.", "", "Paris."),  # thinking turned off: no <think>, all content
    ("qwen3", "<think></think>\n\nHi", "", "Hi"),
    ("qwen3", "<think>cut off while thinking </thi", "cut off while thinking </thi", ""),
    ("qwen3", "<thi", "", "<thi"),
    ("qwen3", "<b>bold</b>", "", "<b>bold</b>"),
    ("qwen3", " \n", "", " \n"),
    ("deepseek_r1", "The capital.\n</think>\n\nParis.", "The capital.\n", "Paris."),  # <think> was in the prompt
    ("deepseek_r1", "<think>x</think>y", "x", "y"),
    ("deepseek_r1", "still thinking", "still thinking", ""),
    ("deepseek_r1", "<thi", "<thi", ""),
    ("deepseek_r1", "</think>", "", ""),
    ("deepseek_r1", "<think>", "", ""),  # cut off right after the tag: no reasoning yet
]


@pytest.mark.parametrize(("rule", "text", "reasoning", "content"), CASES, ids=[f"{c[0]}:{c[1][:20]}" for c in CASES])
def test_reasoning_split_anywhere(rule, text, reasoning, content):
    assert same_everywhere(rule, text) == (reasoning, content, [])


CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'


@pytest.mark.parametrize("rule", ["qwen3", "deepseek_r1"])
def test_tool_calls_are_read_from_the_content_only(rule):
    """A call written while thinking is reasoning; the one after </think> is a call."""
    text = f"<think>Maybe {CALL}?</think>\n\nChecking.\n{CALL}"
    assert same_everywhere(rule, text, tools=True) == (f"Maybe {CALL}?", "Checking.", [("get_time", '{"tz": "UTC"}')])


def test_deltas_and_message_have_vllms_reasoning_field():
    text = "<think>Let me think.</think>\n\nParis."
    streams = ToolStreams(lambda: ReasoningParser("qwen3", None))
    deltas = [d for i in range(0, len(text), 5) for d in streams.deltas(0, text[i : i + 5], i + 5 >= len(text))]
    assert all(list(d) in (["reasoning"], ["content"]) for d in deltas)
    assert "".join(d.get("reasoning", "") for d in deltas) == "Let me think."
    assert "".join(d.get("content", "") for d in deltas) == "Paris."
    assert streams.finish_reason(0, "stop") == "stop"
    assert message(ReasoningParser("qwen3", None), text) == {"role": "assistant", "content": "Paris.",
                                                             "reasoning": "Let me think."}  # fmt: skip
    assert message(ReasoningParser("qwen3", None), "Paris.") == {"role": "assistant", "content": "Paris."}


def test_answers_held_whole_by_a_grammar_or_unconfigured_are_not_split():
    def tools() -> HermesParser:
        return HermesParser()

    whole, after = StructuredOutput("json_object"), StructuredOutput("json_object", reasoning_end=7)
    assert with_reasoning(None, tools, None) is tools and with_reasoning(None, None, after) is None
    assert with_reasoning("qwen3", tools, whole) is tools  # a grammar holds the answer: nothing to split off
    for structured in (None, after):  # free, or a grammar that waits for the thinking's end
        parser = with_reasoning("deepseek_r1", None, structured)
        assert parser is not None and isinstance(parser(), ReasoningParser)


def test_grammars_wait_for_the_thinking_only_where_its_tags_are_tokens():
    """The default model's tokenizer writes <think> in several tokens; a tokenizer.json with the tags as tokens of
    their own (as Qwen3's and DeepSeek-R1's are) gives their ids."""
    plain = Tokenizer(model_dir())
    assert thinking_tokens("qwen3", plain) is None and thinking_tokens("deepseek_r1", plain) is None
    tagged: Any = SimpleNamespace(single_token={START: 11, END: 12}.get)
    assert thinking_tokens("qwen3", tagged) == (11, 12) and thinking_tokens("deepseek_r1", tagged) == (None, 12)
    assert thinking_tokens(None, tagged) is None
    so = StructuredOutput("regex", "a+")
    assert after_thinking(so, None) is so
    assert after_thinking(so, (11, 12)) == StructuredOutput("regex", "a+", reasoning_start=11, reasoning_end=12)


PIECES = ["<think>", "</think>", "<thi", "</thi", "nk>", "<", ">", "/", " ", "\n", "a", "é", CALL, "<tool_call>"]


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12).map("".join), st.lists(st.integers(0, 200), max_size=4),
       st.sampled_from(["qwen3", "deepseek_r1"]), st.booleans())  # fmt: skip
def test_any_text_splits_the_same_however_cut(text, cuts, rule, tools):
    """Never raises; the same reasoning, content and calls whether the text comes whole or in pieces; without
    tools, an answer that does not open with <think> is all content (qwen3) or all reasoning (deepseek_r1) until
    any </think>."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    whole = run(rule, [text], tools)
    assert run(rule, [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)], tools) == whole
    if not tools and not text.lstrip().startswith("<think>"):
        if rule == "qwen3":
            assert whole == ("", text, [])
        elif "</think>" not in text:
            assert whole == (text, "", [])


@pytest.fixture(scope="module")
def tagged(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(tagged_model(tmp_path_factory.mktemp("tagged") / "model"))


WORDS = [START, END, " ", "\n", "a", "b"]  # each one token of the tagged tokenizer


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(st.lists(st.sampled_from(WORDS), max_size=10), st.sampled_from(["qwen3", "deepseek_r1"]))
def test_reasoning_tokens_are_the_tokens_of_the_reasoning(tagged: Tokenizer, words: list[str], rule: str):
    """usage's reasoning_tokens, counted on the ids, is the number of tokens in the reasoning that the parser reads
    from their text: tags inside the thinking count, the tags around it and whitespace before <think> do not."""
    ids = [tagged.single_token(w) for w in words]
    assert None not in ids
    count = ReasoningTokens.of(rule, tagged)
    assert count is not None
    reasoning, _, _ = run(rule, [tagged.decode(ids)])  # type: ignore[arg-type]
    in_reasoning = len(re.findall(r"</think>|<think>|.", reasoning, re.S))
    assert count(ids) == in_reasoning  # type: ignore[arg-type]


def test_reasoning_tokens_need_the_tags_as_tokens(tagged: Tokenizer):
    assert ReasoningTokens.of("qwen3", Tokenizer(model_dir())) is None and ReasoningTokens.of(None, tagged) is None
    count = ReasoningTokens.of("deepseek_r1", tagged)
    assert count is not None and count.start == tagged.single_token(START)
