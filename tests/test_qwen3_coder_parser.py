"""--tool-call-parser qwen3_coder on fixed model outputs: Qwen3-Coder's XML-like calls, values typed by the request's
parameter schemas, multi-line code kept as written, calls between text, malformed calls left as content, closing
tags left out, streams split anywhere; and the plan hands the parser the request's schemas."""

from __future__ import annotations

import json
from typing import Any

import pytest

from frontend.api.protocol import ChatCompletionRequest
from frontend.tools.qwen3_coder_parser import Qwen3CoderParser, typed_value
from frontend.tools.tool_calls import plan_tools
from frontend.tools.tool_parsers import Arguments, CallStart
from tests.test_tool_parsers import same_everywhere

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "metric": {"type": "boolean"}}}  # fmt: skip
WRITE = {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                          "options": {"type": "object"}, "lines": {"type": "array"},
                                          "ratio": {"type": ["number", "null"]}, "mode": {"enum": ["a", "w"]},
                                          "anything": {}}}  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "write_file": WRITE}


def call(name: str, **values: str) -> str:
    blocks = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{blocks}</function>\n</tool_call>"


CODE = 'def f(x):\n    return "<b>" + x\n\n'
CASES = [
    # (model output, content, calls as (name, arguments))
    ("Paris is sunny.", "Paris is sunny.", []),
    (call("get_weather", city="Paris", days="3", metric="true"), "",
     [("get_weather", {"city": "Paris", "days": 3, "metric": True})]),
    (f"Let me check.\n\n{call('get_weather', city='Paris')}\n{call('get_weather', city='Tokyo', days='2')}",
     "Let me check.", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo", "days": 2})]),
    # Code spans lines as written (only the newlines the template adds around a value are taken off).
    (call("write_file", path="a.py", content=CODE), "", [("write_file", {"path": "a.py", "content": CODE})]),
    # Values typed by the schema; what does not read as its type stays text, and so does an unknown parameter.
    (call("write_file", options='{"x": [1, 2]}', lines="[1, 2]", ratio="0.5", mode="w", anything='{"k": 1}'), "",
     [("write_file", {"options": {"x": [1, 2]}, "lines": [1, 2], "ratio": 0.5, "mode": "w", "anything": {"k": 1}})]),
    (call("get_weather", days="three", metric="yes", extra="42"), "",
     [("get_weather", {"days": "three", "metric": "yes", "extra": "42"})]),
    (call("write_file", ratio="null", path="null"), "", [("write_file", {"ratio": None, "path": "null"})]),
    # A function the tools do not define: its values as text.
    (call("other", n="1"), "", [("other", {"n": "1"})]),
    # Closing tags the model left out where the next tag or the end makes them plain.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</tool_call>", "",
     [("get_weather", {"city": "Paris", "days": 2})]),
    ("<tool_call><function=get_weather></function></tool_call>", "", [("get_weather", {})]),
    # Not this format: content, exactly as written.
    ("<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", []),
    ("<tool_call><function=f>stray<parameter=a>1</parameter></function></tool_call>",
     "<tool_call><function=f>stray<parameter=a>1</parameter></function></tool_call>", []),
    ("<tool_call><function=f><parameter=a>1</parameter></function> and more</tool_call>",
     "<tool_call><function=f><parameter=a>1</parameter></function> and more</tool_call>", []),
    ("<tool_call><function=>", "<tool_call><function=>", []),
]


def decoded(result: Any) -> tuple[str, list[tuple[str, Any]]]:
    content, calls, _ = result
    return content, [(name, json.loads(arguments)) for name, arguments in calls]


@pytest.mark.parametrize(("text", "content", "calls"), CASES, ids=[c[0][:40] for c in CASES])
def test_qwen3_coder_outputs_split_anywhere(text: str, content: str, calls: list[tuple[str, Any]]) -> None:
    assert decoded(same_everywhere(lambda: Qwen3CoderParser(None, SCHEMAS), text)) == (content, calls)


@pytest.mark.parametrize(("text", "schema", "value"), [
    ("12", {"type": "integer"}, 12), ("1_000", {"type": "integer"}, "1_000"), ("1.5", {"type": "integer"}, "1.5"),
    ("-2.5e3", {"type": "number"}, -2500.0), ("7", {"type": "number"}, 7), ("nan", {"type": "number"}, "nan"),
    ("1e999", {"type": "number"}, "1e999"), ("True", {"type": "boolean"}, True), ("[1]", {"type": "object"}, "[1]"),
    (" NULL ", {"type": "integer"}, None), ("NaN", {}, "NaN"), ("[" * 5000, {"type": "array"}, "[" * 5000),
    ("9" * 500, {"type": "integer"}, "9" * 500),
])  # fmt: skip
def test_typed_values(text: str, schema: dict[str, Any], value: Any) -> None:
    assert typed_value(text, schema) == value


def test_the_plan_gives_the_parser_the_requests_schemas_and_parallel_false_keeps_the_first() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                "parallel_tool_calls": False})  # fmt: skip
    factory = plan_tools(req, "qwen3_coder").make_parser()
    assert factory is not None
    parser = factory()
    events = parser.feed(call("get_weather", days="4") + call("get_weather", days="5")) + parser.finish()
    assert [type(e) for e in events] == [CallStart, Arguments] and json.loads(events[1].text) == {"days": 4}
