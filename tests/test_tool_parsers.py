"""Tool-call parsers on fixed model outputs: hermes tags, Llama 3's JSON calls and pythonic lists of calls (several
calls, text around, malformed calls, streams split at every position), the JSON of forced calls, and OpenAI's
streamed tool_calls delta shape."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.api.protocol import ChatCompletionRequest
from frontend.tools.mistral_parser import MistralParser
from frontend.tools.pythonic_parser import PythonicParser
from frontend.tools.tool_calls import plan_tools
from frontend.tools.tool_forced import ForcedCallsParser, NamedCallParser
from frontend.tools.tool_parsers import (
    Arguments,
    CallStart,
    Content,
    Event,
    HermesParser,
    Llama3JsonParser,
    ToolParser,
)
from frontend.tools.tool_stream import ToolStreams, finish_reason, message

Result = tuple[str, list[tuple[str, str]], int]  # content, [(name, arguments)], complete calls


def events_of(parser: ToolParser, pieces: list[str]) -> tuple[list[Event], str, list[tuple[str, str]]]:
    """The parser's events for the text in these pieces, its content, and its calls as (name, arguments)."""
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: list[list[str]] = []
    for e in events:
        if isinstance(e, CallStart):
            mistral = type(parser) is MistralParser  # nine letters and digits, as Mistral's templates demand
            assert e.index == len(calls) and re.fullmatch(r"[A-Za-z0-9]{9}" if mistral else r"call_\w{17,}", e.id)
            calls.append([e.name, ""])
        elif isinstance(e, Arguments):
            calls[e.index][1] += e.text
    return events, content, [(n, a) for n, a in calls]


def run(make: Callable[[], ToolParser], pieces: list[str]) -> Result:
    parser = make()
    _, content, calls = events_of(parser, pieces)
    return content, calls, parser.calls


def splits(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and cut in two at every position."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


def same_everywhere(make: Callable[[], ToolParser], text: str) -> Result:
    results = {repr(run(make, pieces)) for pieces in splits(text)}
    assert len(results) == 1, results
    return run(make, [text])


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'

HERMES_CASES = [
    # (model output, content, calls, complete calls)
    ("The capital is Paris.", "The capital is Paris.", [], 0),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", '{"city": "Paris", "unit": "celsius"}')], 1),
    (f"Let me check.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\nDone. ",
     "Let me check.Done. ", [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                            ("get_time", '{"tz": "Europe/Paris"}')], 2),
    # Malformed calls stay text, exactly as written (the whitespace before them too).
    ('Hi <tool_call>{"name": "f", "arguments": {"a": }}</tool_call> there',
     'Hi <tool_call>{"name": "f", "arguments": {"a": }}</tool_call> there', [], 0),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', [], 0),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     [], 0),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', [], 0),
    (f"<tool_call>not json</tool_call> <tool_call>{TIME}</tool_call>", "<tool_call>not json</tool_call>",
     [("get_time", '{"tz": "Europe/Paris"}')], 1),
    # A call the model ended without its closing tag counts when its JSON is whole; a cut one is text.
    (f"<tool_call>\n{TIME}\n", "", [("get_time", '{"tz": "Europe/Paris"}')], 1),
    ('ok <tool_call>{"name": "get_time", "argu', 'ok <tool_call>{"name": "get_time", "argu', [], 0),
    # Look-alikes of the tag are text.
    ("a <tool_c", "a <tool_c", [], 0),
    ("x < y and <tool>call</tool> <tool_callx", "x < y and <tool>call</tool> <tool_callx", [], 0),
    # A missing "arguments" is a call without arguments; a name with escapes is decoded.
    ('<tool_call>{"name": "caf\\u00e9"}</tool_call>', "", [("café", "{}")], 1),
    ("  \n", "  \n", [], 0),
]


@pytest.mark.parametrize(("text", "content", "calls", "complete"), HERMES_CASES, ids=[c[0][:30] for c in HERMES_CASES])
def test_hermes_outputs_split_anywhere(text, content, calls, complete):
    assert same_everywhere(HermesParser, text) == (content, calls, complete)


def test_hermes_split_inside_both_tags():
    text = f"Sure.<tool_call>{WEATHER}</tool_call>"
    pieces = ["Sure.<tool", "_ca", "ll>", WEATHER[:9], WEATHER[9:], "</tool_", "call", ">"]
    assert run(HermesParser, pieces) == ("Sure.", [("get_weather", json.dumps(json.loads(WEATHER)["arguments"]))], 1)
    assert run(HermesParser, pieces) == run(HermesParser, [text])


def test_hermes_content_streams_before_the_tag():
    parser = HermesParser()
    assert parser.feed("Let me look that up") == [Content("Let me look that up")]
    assert parser.feed(" <tool_") == []  # whitespace and what may be a tag wait
    assert parser.feed("call>{") == []  # a call is held until it is whole
    events = parser.feed(TIME[1:] + "</tool_call>")
    assert [type(e) for e in events] == [CallStart, Arguments] and parser.calls == 1



CITY = '{"city": "Paris", "unit": "celsius"}'
LLAMA_WEATHER = '{"name": "get_weather", "parameters": ' + CITY + "}"
LLAMA_TIME = '{"type": "function", "name": "get_time", "arguments": {"tz": "Europe/Paris"}}'  # Llama 3.2 adds a type
PARIS, TZ = ("get_weather", CITY), ("get_time", '{"tz": "Europe/Paris"}')

LLAMA_CASES = [
    # (model output, content, calls, complete calls)
    ("The capital is Paris.", "The capital is Paris.", [], 0),
    (LLAMA_WEATHER, "", [PARIS], 1),
    (f"\n<|python_tag|> {LLAMA_WEATHER}", "", [PARIS], 1),
    (f"{LLAMA_WEATHER}; {LLAMA_TIME}", "", [PARIS, TZ], 2),
    (f"{LLAMA_WEATHER}\n{LLAMA_TIME}\n\nI asked for both.", "I asked for both.", [PARIS, TZ], 2),
    # Calls only where the answer begins: a JSON answer that is not a call is content, exactly as written.
    (f"Sure: {LLAMA_WEATHER}", f"Sure: {LLAMA_WEATHER}", [], 0),
    (' {"name": "Felix", "age": 4} and more', ' {"name": "Felix", "age": 4} and more', [], 0),
    ('{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', [], 0),
    ('{"parameters": {}}', '{"parameters": {}}', [], 0),
    ('{"name": "f", "parameters": {"x": NaN}}', '{"name": "f", "parameters": {"x": NaN}}', [], 0),
    (f"{LLAMA_WEATHER}; [1, 2]", "[1, 2]", [PARIS], 1),
    (f'{LLAMA_WEATHER}; {{"note": 1}} x', '{"note": 1} x', [PARIS], 1),
    # Cut off by the end: content as written.
    ('{"name": "get_time", "parameters": {"tz": ', '{"name": "get_time", "parameters": {"tz": ', [], 0),
    (f'{LLAMA_WEATHER}; {{"name": "get_ti', '{"name": "get_ti', [PARIS], 1),
    ('{"name": "caf\\u00e9", "parameters": {}}', "", [("café", "{}")], 1),
    ("<|py", "<|py", [], 0),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", [], 0),
    ("  \n", "  \n", [], 0),
]


@pytest.mark.parametrize(("text", "content", "calls", "complete"), LLAMA_CASES, ids=[c[0][:30] for c in LLAMA_CASES])
def test_llama3_json_outputs_split_anywhere(text, content, calls, complete):
    assert same_everywhere(Llama3JsonParser, text) == (content, calls, complete)


def test_llama3_json_streams_content_and_holds_calls():
    parser = Llama3JsonParser()
    assert parser.feed(" ") == [] and parser.feed("It is sunny") == [Content(" It is sunny")]
    assert parser.feed(" {") == [Content(" {")]  # once content, always content
    parser = Llama3JsonParser()
    assert parser.feed(LLAMA_WEATHER[:-1]) == []  # a call is held until its object closes
    events = parser.feed("}; ")
    assert [type(e) for e in events] == [CallStart, Arguments] and parser.calls == 1
    assert parser.feed("Done") == [Content("Done")]



PYTHONIC = '[get_weather(city="Paris", unit="celsius"), get_time(tz="Europe/Paris")]'
PYTHONIC_CASES = [
    # (model output, content, calls)
    ("The capital is Paris.", "The capital is Paris.", []),
    (PYTHONIC, "", [PARIS, TZ]),
    (f"\n {PYTHONIC}\n\nI asked for both.", "I asked for both.", [PARIS, TZ]),
    ('[f(a=[1, {"b": None, "c": True}], s="x]y"), g()]', "", [("f", '{"a": [1, {"b": null, "c": true}], "s": "x]y"}'),
                                                             ("g", "{}")]),
    # Not a list of calls with literal keyword arguments: content, exactly as written.
    ("Sure: [f()]", "Sure: [f()]", []),
    ("[1, 2] is a list", "[1, 2] is a list", []),
    ("[f(1)]", "[f(1)]", []),
    ("[f(a=x)]", "[f(a=x)]", []),
    ("[f(**kw)]", "[f(**kw)]", []),
    ("[f(a={1, 2})]", "[f(a={1, 2})]", []),
    ("[f(a=1e999)]", "[f(a=1e999)]", []),
    ("[os.system(c='ls')]", "[os.system(c='ls')]", []),
    ("[]", "[]", []),
    ('[get_time(tz="UTC"', '[get_time(tz="UTC"', []),  # cut off by the end
    ("  \n", "  \n", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), PYTHONIC_CASES, ids=[c[0][:30] for c in PYTHONIC_CASES])
def test_pythonic_outputs_split_anywhere(text, content, calls):
    assert same_everywhere(PythonicParser, text) == (content, calls, len(calls))


NAMED = '{"city": "Par\\"is}", "days": [1, 2, {"x": null}], "n": -1.5e3, "ok": true}'


def test_named_call_is_the_arguments_object():
    assert same_everywhere(lambda: NamedCallParser("get_weather"), NAMED) == ("", [("get_weather", NAMED)], 1)
    assert same_everywhere(lambda: NamedCallParser("f"), "  " + NAMED + " ") == ("", [("f", NAMED)], 1)
    # Cut short (max_tokens): the call with its arguments so far, not complete.
    assert run(lambda: NamedCallParser("f"), [NAMED[:20]]) == ("", [("f", NAMED[:20])], 0)
    # Output not held to the schema is content.
    assert same_everywhere(lambda: NamedCallParser("f"), " Paris is nice") == (" Paris is nice", [], 0)


REQUIRED = ('[{"name": "get_weather", "arguments": {"city": "[Paris]", "q": "\\"{"}}, '
            '{"arguments": {"tz": "UTC", "n": 5}, "name": "get_time"}, {"name": "noop", "arguments": {}}]')


def test_required_calls_in_any_key_order():
    content, calls, complete = same_everywhere(ForcedCallsParser, REQUIRED)
    assert content == "" and complete == 3
    assert calls == [(c["name"], json.dumps(c["arguments"])) for c in json.loads(REQUIRED)]
    # The arguments stream as written: before the array ends, the first call's are there already.
    assert run(ForcedCallsParser, [REQUIRED[:60]])[1] == [("get_weather", REQUIRED[REQUIRED.index("{\"city"):60])]
    assert same_everywhere(ForcedCallsParser, "no calls") == ("no calls", [], 0)


def test_stream_deltas_have_openai_shape():
    streams = ToolStreams(ForcedCallsParser)
    deltas = []
    for i in range(0, len(REQUIRED), 7):
        deltas += streams.deltas(0, REQUIRED[i : i + 7], final=i + 7 >= len(REQUIRED))
    assert streams.finish_reason(0, "stop") == "tool_calls" and streams.finish_reason(0, "length") == "length"
    arguments: dict[int, str] = {}
    for d in deltas:
        assert list(d) == ["tool_calls"] and len(d["tool_calls"]) == 1
        call = d["tool_calls"][0]
        if call["index"] not in arguments:  # the call's first delta: its id, type and name, no arguments yet
            assert call["id"].startswith("call_") and call["type"] == "function"
            assert call["function"] == {"name": call["function"]["name"], "arguments": ""}
            arguments[call["index"]] = ""
        else:  # then pieces of the arguments only
            assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            arguments[call["index"]] += call["function"]["arguments"]
    assert [json.loads(arguments[i]) for i in range(3)] == [c["arguments"] for c in json.loads(REQUIRED)]


def test_whole_message():
    msg = message(HermesParser(), f"Checking.\n<tool_call>{TIME}</tool_call>")
    assert msg["content"] == "Checking." and msg["tool_calls"][0]["function"] == {
        "name": "get_time", "arguments": '{"tz": "Europe/Paris"}'}  # fmt: skip
    named = message(NamedCallParser("f"), "{}")
    assert named["content"] is None and named["tool_calls"][0]["id"].startswith("call_")
    assert named["tool_calls"][0]["type"] == "function" and named["tool_calls"][0]["function"] == {
        "name": "f", "arguments": "{}"}  # fmt: skip
    plain = message(HermesParser(), "no tools here ")
    assert plain == {"role": "assistant", "content": "no tools here "}
    assert finish_reason(HermesParser(), "stop") == "stop"


@pytest.mark.parametrize(("parser", "text", "content"), [
    ("hermes", f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\nDone.",
     "Let me check.Done."),
    ("llama3_json", f"{LLAMA_WEATHER}; {LLAMA_TIME}\n\nDone.", "Done."),
    ("pythonic", f"{PYTHONIC}\nDone.", "Done."),
])  # fmt: skip
def test_parallel_tool_calls_false_keeps_only_the_first_call(parser, text, content):
    """OpenAI answers at most one call then: the chat stream, the whole message and /v1/responses all take their
    parser from the plan (the server's --tool-call-parser), so each drops the later calls."""
    tools = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]

    def make(**fields: object) -> Callable[[], ToolParser]:
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                    **fields})  # fmt: skip
        factory = plan_tools(req, parser).make_parser()
        assert factory is not None
        return factory

    assert same_everywhere(make(parallel_tool_calls=False), text) == (content, [PARIS], 1)
    assert same_everywhere(make(), text) == (content, [PARIS, TZ], 2)
    msg = message(make(parallel_tool_calls=False)(), text)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]


# Text made of the pieces parsers care about: tags (whole and cut), JSON punctuation, names, whitespace.
PIECES = ["<tool_call>", "</tool_call>", "<tool_", "call>", "</tool", "<", ">", "{", "}", "[", "]", ",", ":", '"',
          "\\", '\\"', '"name"', '"arguments"', '"parameters"', '"get_time"', "{}", "1.5", "true", "null", " ", "\n",
          "hi", "é", ";", "<|python_tag|>", "<|py"]  # fmt: skip
TEXTS = st.lists(st.sampled_from(PIECES + ["(", ")", "=", "f", "x", "'", PYTHONIC, WEATHER, TIME, REQUIRED, NAMED,
                                            LLAMA_WEATHER, LLAMA_TIME]), max_size=12).map("".join)  # fmt: skip
PARSERS = [HermesParser, ForcedCallsParser, lambda: NamedCallParser("f"), Llama3JsonParser, PythonicParser]


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(TEXTS, st.lists(st.integers(0, 400), max_size=4), st.sampled_from(range(len(PARSERS))))
def test_any_text_parses_the_same_however_split(text, cuts, which):
    """Never raises; the same content and calls whether the text comes whole or in pieces."""
    make = PARSERS[which]
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    whole = run(make, [text])
    assert run(make, pieces) == whole
    if which in (0, 3, 4) and not whole[1]:  # hermes, llama3_json or pythonic without a call: all content, exactly
        assert whole[0] == text
