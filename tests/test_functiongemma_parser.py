"""FunctionGemma's tool-call format (frontend/tools/functiongemma_parser.py): every value it writes, read the same
however the text is split; what is not a whole call stays content, exactly as written; the plan keeps special
tokens and stops where the model would imagine the function's answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.api.protocol import ChatCompletionRequest
from frontend.tools.functiongemma_parser import FunctionGemmaParser, parse_functiongemma_call
from frontend.tools.tool_calls import plan_tools
from tests.test_tool_parsers import run, same_everywhere

E = "<escape>"
WEATHER = f"<start_function_call>call:get_weather{{city:{E}Paris, France{E},days:3}}<end_function_call>"
TIME = f"<start_function_call>call:get_time{{tz:{E}Europe/Paris{E}}}<end_function_call>"

CASES = [
    # (model output, content, calls as (name, arguments), complete calls)
    ("The capital is Paris.", "The capital is Paris.", [], 0),
    (WEATHER, "", [("get_weather", {"city": "Paris, France", "days": 3})], 1),
    (f"Let me check.\n{WEATHER}{TIME}", "Let me check.",
     [("get_weather", {"city": "Paris, France", "days": 3}), ("get_time", {"tz": "Europe/Paris"})], 2),
    ("<start_function_call>call:refresh{}<end_function_call>", "", [("refresh", {})], 1),
    # Strings hold the format's own punctuation; every kind of value, nested.
    (f"<start_function_call>call:note{{text:{E}a {{b}}, [c]: \"d\"{E},n:-1.5e3,ok:true,none:null,"
     f"tags:[{E}x{E},2,[false]],at:{{lat:48.85,lon:2.35}}}}<end_function_call>", "",
     [("note", {"text": 'a {b}, [c]: "d"', "n": -1500.0, "ok": True, "none": None, "tags": ["x", 2, [False]],
                "at": {"lat": 48.85, "lon": 2.35}})], 1),
    # A bare word the model did not escape is its text.
    ("<start_function_call>call:set{mode:fast, level : 2}<end_function_call>", "",
     [("set", {"mode": "fast", "level": 2})], 1),
    # Not a whole call: content, exactly as written.
    (f"<start_function_call>call:f{{a:{E}open}}<end_function_call>", f"<start_function_call>call:f{{a:{E}open}}"
     "<end_function_call>", [], 0),
    ("<start_function_call>get_time{}<end_function_call>", "<start_function_call>get_time{}<end_function_call>", [], 0),
    ("<start_function_call>call:f{a:1} extra<end_function_call>",
     "<start_function_call>call:f{a:1} extra<end_function_call>", [], 0),
    ("<start_function_call>call:f{a:,b:1}<end_function_call>", "<start_function_call>call:f{a:,b:1}<end_function_call>",
     [], 0),
    ("<start_function_call>call:f{a:NaN}<end_function_call>", "", [("f", {"a": "NaN"})], 1),  # not JSON's number
    ("ok <start_function_call>call:get_ti", "ok <start_function_call>call:get_ti", [], 0),
    ("a <start_function", "a <start_function", [], 0),
]


@pytest.mark.parametrize(("text", "content", "calls", "complete"), CASES, ids=[c[0][:40] for c in CASES])
def test_functiongemma_outputs_split_anywhere(text, content, calls, complete):
    got_content, got_calls, got_complete = same_everywhere(FunctionGemmaParser, text)
    assert (got_content, [(n, json.loads(a)) for n, a in got_calls], got_complete) == (content, calls, complete)


def test_nesting_is_bounded() -> None:
    deep = "call:f{a:" + "[" * 200 + "]" * 200 + "}"
    assert parse_functiongemma_call(deep) is None
    assert parse_functiongemma_call("call:f{a:" + "[" * 60 + "]" * 60 + "}") is not None


def test_one_call_when_parallel_calls_are_off_and_the_plan_keeps_special_tokens_and_stops() -> None:
    tools = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                "parallel_tool_calls": False})  # fmt: skip
    plan = plan_tools(req, "functiongemma")
    assert plan.keeps_special_tokens and plan.stop == ["<start_function_response>"]
    factory = plan.make_parser()
    assert factory is not None
    assert run(factory, [WEATHER + TIME])[1] == [("get_weather", '{"city": "Paris, France", "days": 3}')]
    none = plan_tools(req.model_copy(update={"tool_choice": "none"}), "functiongemma")
    assert not none.keeps_special_tokens and none.stop == []


PIECES = ["<start_function_call>", "<end_function_call>", "<start_func", "tion_call>", E, "<esc", "call:", "f", "{",
          "}", "[", "]", ",", ":", "1.5", "true", "null", " ", "\n", "é", WEATHER, TIME]  # fmt: skip


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12).map("".join), st.lists(st.integers(0, 400), max_size=4))
def test_any_text_parses_the_same_however_split(text, cuts):
    """Never raises; the same content and calls whole or in pieces; without a call, all of it is content."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    whole = run(FunctionGemmaParser, [text])
    assert run(FunctionGemmaParser, [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]) == whole
    if not whole[1]:
        assert whole[0] == text
