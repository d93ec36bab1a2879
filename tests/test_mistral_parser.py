"""--tool-call-parser mistral on fixed model outputs (both spellings of Mistral's calls, text around them, stray and
malformed tags, streams split anywhere), and on the server: special tokens kept in the text of a request it
parses. Its call over HTTP with the official client is in test_api_tools.test_auto_tool_choice_parsers_on_the_server.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.api.protocol import ChatCompletionRequest
from frontend.tools.mistral_parser import ARGS, CALL_ID, TAG, MistralParser
from frontend.tools.tool_calls import plan_tools
from frontend.tools.tool_parsers import Content
from tests.conftest import Server
from tests.engine_helpers import tokenizer
from tests.test_tool_parsers import run, same_everywhere

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
TIME = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
PARIS, UTC = ("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"tz": "UTC"}')

CASES = [
    # (model output, content, calls)
    ("The capital is Paris.", "The capital is Paris.", []),
    # Before tokenizer v11: a JSON list after the tag (a lone object is a list of one).
    (f"{TAG} [{WEATHER}, {TIME}]", "", [PARIS, UTC]),
    (f"Let me check.\n{TAG}{TIME}\n", "Let me check.", [UTC]),
    # v11 and later: name[ARGS]{...} after each tag, maybe with a [CALL_ID] (which is not ours to keep).
    (f'{TAG}get_weather{ARGS}{{"city": "Paris", "days": 3}}{TAG}get_time{CALL_ID}a1B2c3D4e{ARGS} {{"tz": "UTC"}}',
     "", [PARIS, UTC]),
    (f'Sure.  {TAG}get_time{ARGS}{{"tz": "UTC"}}  \n Done.', "Sure.Done.", [UTC]),
    (f"{TAG}f{ARGS}{{}}", "", [("f", "{}")]),
    # A tag that leads to no calls is text, as written, and so is a call the answer cut off.
    (f"Hi {TAG} no call here", f"Hi {TAG} no call here", []),
    (f"{TAG}[1, 2] and {TAG}[{{\"arguments\": {{}}}}]", f"{TAG}[1, 2] and {TAG}[{{\"arguments\": {{}}}}]", []),
    (f'{TAG}f{ARGS}["a"]', f'{TAG}f{ARGS}["a"]', []),
    (f'{TAG}f{ARGS}{{"x": NaN}}', f'{TAG}f{ARGS}{{"x": NaN}}', []),
    (f'a {TAG}get_weather{ARGS}{{"city": "Par', f'a {TAG}get_weather{ARGS}{{"city": "Par', []),
    (f"x {TAG}", f"x {TAG}", []),
    ("[TOOL_CA", "[TOOL_CA", []),
    (f"{TAG}bad name{ARGS}{{}}", f"{TAG}bad name{ARGS}{{}}", []),
    # A stray tag after calls is text too; the calls stand.
    (f"{TAG}[{TIME}] {TAG} oops", f"{TAG} oops", [UTC]),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES, ids=[c[0][:30] for c in CASES])
def test_mistral_outputs_split_anywhere(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    assert same_everywhere(MistralParser, text) == (content, calls, len(calls))


def test_content_streams_and_a_stray_tag_does_not_hold_the_answer() -> None:
    parser = MistralParser()
    assert parser.feed("Let me look") == [Content("Let me look")]
    assert parser.feed(" [TOOL_") == []  # whitespace and what may be a tag wait
    assert parser.feed("CALLS]get_time[ARGS]{") == []  # a call is held until it is whole
    assert [type(e).__name__ for e in parser.feed('"tz": "UTC"}')] == ["CallStart", "Arguments"]
    stray = MistralParser()
    stray.feed(f"{TAG}Sorry")
    assert stray.feed(", no.") == [Content(TAG), Content("Sorry, no.")]  # a name has no space: not a call


def test_parallel_tool_calls_false_keeps_the_first_and_special_tokens_are_kept_only_for_auto() -> None:
    tools = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]

    def plan(**fields: object):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                    **fields})  # fmt: skip
        return plan_tools(req, "mistral")

    factory = plan(parallel_tool_calls=False).make_parser()
    assert factory is not None and same_everywhere(factory, f"{TAG}[{WEATHER}, {TIME}]") == ("", [PARIS], 1)
    assert plan().keeps_special_tokens and not plan(tool_choice="required").keeps_special_tokens
    assert not plan(tool_choice="none").keeps_special_tokens


PIECES = [TAG, ARGS, CALL_ID, "[TOOL_", "CALLS]", "[ARG", "[", "]", "{", "}", ",", ":", '"', "f", "get_time", "1",
          '"name"', '"arguments"', "{}", " ", "\n", "hi", "é", WEATHER, TIME, '{"tz": "UTC"}']  # fmt: skip


@settings(max_examples=400, derandomize=True, deadline=None, database=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12).map("".join), st.lists(st.integers(0, 300), max_size=4))
def test_any_text_parses_the_same_however_split(text: str, cuts: list[int]) -> None:
    """Never raises; the same content and calls whole or in pieces; without a call, all content, exactly."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    whole = run(MistralParser, [text])
    assert run(MistralParser, [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]) == whole
    if not whole[1]:
        assert whole[0] == text


def test_a_request_it_parses_keeps_special_tokens(tool_servers: dict[str, Server]) -> None:
    """Mistral's tags are special tokens in its tokenizers, so a chat request with tools under --tool-call-parser
    mistral keeps special tokens in its text (the parser sees the tag), as vLLM does; others skip them as usual."""
    special = tokenizer().convert_tokens_to_ids("<jupyter_start>")  # one of the default model's special tokens
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
            "logit_bias": {str(special): 100}, "tools": [{"type": "function", "function": {"name": "f"}}]}

    def content(server: str, **extra: object) -> str:
        r = httpx.post(tool_servers[server].url + "/v1/chat/completions", json={**body, **extra}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    assert content("mistral") == "<jupyter_start>" * 3
    assert content("mistral", tools=None) == content("hermes") == ""
