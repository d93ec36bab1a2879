"""--tool-call-parser granite on fixed model outputs: Granite 3's `<|tool_call|>` and a JSON list of calls, text
before it, a tag that leads to no calls, streams split anywhere, OpenAI's kind of call id; and its plan keeps special
tokens (the tag is one in Granite's tokenizer)."""

from __future__ import annotations

import pytest

from frontend.api.protocol import ChatCompletionRequest
from frontend.tools.granite_parser import TAG, GraniteParser
from frontend.tools.tool_calls import plan_tools
from frontend.tools.tool_parsers import CallStart, Content
from tests.test_tool_parsers import same_everywhere

WEATHER = '{"name": "get_weather", "arguments": {"city": "Boston", "unit": "fahrenheit"}}'
TIME = '{"name": "get_time", "arguments": {}}'
BOSTON, NOW = ("get_weather", '{"city": "Boston", "unit": "fahrenheit"}'), ("get_time", "{}")

CASES = [
    # (model output, content, calls)
    ("It is sunny in Boston.", "It is sunny in Boston.", []),
    (f"{TAG}[{WEATHER}]", "", [BOSTON]),
    (f"{TAG}[{WEATHER}, {TIME}]", "", [BOSTON, NOW]),
    (f"Let me check. {TAG} [{TIME}]\n", "Let me check.", [NOW]),
    # A tag that leads to no calls is content, as written, and so is a list the answer cut off.
    (f"{TAG} not a call", f"{TAG} not a call", []),
    (f'{TAG}[{{"name": "get_weather", "arguments": {{"city": "Bos', f'{TAG}[{{"name": "get_weather", '
     '"arguments": {"city": "Bos', []),
    (f"{TAG}[1]", f"{TAG}[1]", []),
    ("<|tool_ca", "<|tool_ca", []),
    # Mistral's tag is nothing special here.
    (f"[TOOL_CALLS][{TIME}]", f"[TOOL_CALLS][{TIME}]", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES, ids=[c[0][:30] for c in CASES])
def test_granite_outputs_split_anywhere(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    assert same_everywhere(GraniteParser, text) == (content, calls, len(calls))


def test_content_streams_until_the_tag_and_calls_wait_for_their_json() -> None:
    parser = GraniteParser()
    assert parser.feed("Checking") == [Content("Checking")]
    assert parser.feed(" <|tool_") == []  # what may be the tag waits
    assert parser.feed(f"call|>[{WEATHER[:20]}") == []  # a call is held until its list closes
    start, arguments = parser.feed(WEATHER[20:] + "]")
    assert isinstance(start, CallStart) and start.name == "get_weather" and start.id.startswith("call_")
    assert arguments.text == BOSTON[1] and parser.finish() == []


def test_the_plan_keeps_special_tokens_and_parallel_tool_calls_false_keeps_the_first() -> None:
    tools = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]

    def plan(**fields: object):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                    **fields})  # fmt: skip
        return plan_tools(req, "granite")

    assert plan().keeps_special_tokens and not plan(tool_choice="required").keeps_special_tokens
    factory = plan(parallel_tool_calls=False).make_parser()
    assert factory is not None and same_everywhere(factory, f"{TAG}[{WEATHER}, {TIME}]") == ("", [BOSTON], 1)
