"""Tool calling end to end with the official openai client: forced calls (tool_choice "required" and a named
function, through constrained decoding) streamed and not, tool results sent back, each model format's parser on a
server started with --tool-call-parser and a tool-aware --chat-template, and 400s for bad tool requests."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import Server
from tests.test_api_streaming import assert_engine_idle_within

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}  # fmt: skip
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
HERMES = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'


@pytest.fixture(scope="module")
def server(tool_servers: dict[str, Server]) -> Server:
    return tool_servers["hermes"]


def check_calls(calls: list[dict[str, Any]], names: set[str]) -> None:
    """Each call as OpenAI shapes it, for one of `names`, with arguments that validate against its parameters."""
    assert calls
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function" and call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])
    assert len({c["id"] for c in calls}) == len(calls)


def from_stream(chunks: list[Any]) -> tuple[str, list[dict[str, Any]], str | None]:
    """Content, calls and finish_reason of a stream, checking every tool_calls delta has OpenAI's shape."""
    content, calls, finish = "", [], None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.index == len(calls):  # first delta of a call: id, type, name and no arguments yet
                    assert tc.id and tc.type == "function" and tc.function.name and tc.function.arguments == ""
                    calls.append({"id": tc.id, "type": tc.type, "function": {"name": tc.function.name,
                                                                             "arguments": ""}})  # fmt: skip
                else:  # then only pieces of its arguments
                    assert tc.index == len(calls) - 1 and tc.id is None and tc.function.name is None
                    calls[tc.index]["function"]["arguments"] += tc.function.arguments
            assert finish is None, "nothing after the finish chunk"
            finish = choice.finish_reason
    return content, calls, finish


def test_forced_calls_streamed_and_not(server: Server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [("required", {"get_weather", "get_time"}), (named, {"get_weather"})]

    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
            calls = []
            for choice, _ in cases:
                kw = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": 64,
                      "temperature": 0}  # fmt: skip
                calls += [c.chat.completions.create(**kw), c.chat.completions.create(**kw, stream=True)]
            calls.append(c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                   parallel_tool_calls=False, max_tokens=64, n=2, temperature=1,
                                                   seed=7))  # fmt: skip
            results = await asyncio.gather(*calls)
            return [r if not isinstance(r, openai.AsyncStream) else [x async for x in r] for r in results]

    results = asyncio.run(run())
    for i, (_, names) in enumerate(cases):
        whole, streamed = results[2 * i], results[2 * i + 1]
        msg = whole.choices[0].message
        assert whole.choices[0].finish_reason == "tool_calls" and msg.content is None
        check_calls([c.model_dump() for c in msg.tool_calls], names)
        content, calls, finish = from_stream(streamed)
        assert finish == "tool_calls" and content == ""
        check_calls(calls, names)
        # Greedy: the stream's pieces concatenate to the same calls as the whole response.
        assert [c["function"] for c in calls] == [c.function.model_dump() for c in msg.tool_calls]
    for choice in results[-1].choices:  # parallel_tool_calls false: exactly one call per choice
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_calls([c.model_dump() for c in choice.message.tool_calls], {"get_weather", "get_time"})
    assert_engine_idle_within(server, 5.0)


def test_conversation_with_calls_and_results(server: Server):
    call = {"id": "call_0a1b2c", "type": "function", "function": {"name": "get_weather",
            "arguments": '{"city": "Paris", "days": 3}'}}  # fmt: skip
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 22 C"}]
    named = {"type": "function", "function": {"name": "get_time"}}

    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
            return await asyncio.gather(
                c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4),
                c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named),
                c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1))  # fmt: skip

    reply, again, alone = asyncio.run(run())
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.content
    # The call and its result are in the prompt (the template writes both).
    assert reply.usage.prompt_tokens > alone.usage.prompt_tokens + 20
    assert again.choices[0].finish_reason == "tool_calls"
    check_calls([c.model_dump() for c in again.choices[0].message.tool_calls], {"get_time"})


@pytest.mark.parametrize(("parser", "output", "content"), [
    ("hermes", "Sure.\n" + HERMES, "Sure."),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', "Sure."),
    ("pythonic", '[get_weather(city="Paris", days=3)]', None),
    # Stopped where FunctionGemma would go on to imagine the function's answer.
    ("functiongemma", "Sure.<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}"
                      "<end_function_call><start_function_response>response:get_weather{t:9}", "Sure."),
])  # fmt: skip
def test_auto_tool_choice_parsers_on_the_server(tool_servers: dict[str, Server], parser, output, content):
    """tool_choice auto with the server's --tool-call-parser (llama3_json's server started as vLLM's docs start one
    for Llama 3, with --enable-auto-tool-choice): the model's output is held to the parser's format by a regex (the
    small model would not write one itself), and goes through the parser like any model's would."""
    server = tool_servers[parser]
    regex = re.sub(r"([.{}\[\]()])", r"\\\1", output)
    # Sampled at temperature 1, the forced text may come out in tokens as short as one character (88 of them).
    kw = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 128, "extra_body": {"guided_regex": regex}}

    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
            create = c.chat.completions.create
            whole, stream, plain = await asyncio.gather(create(**kw), create(**kw, stream=True),
                                                        create(**kw, tool_choice="none"))  # fmt: skip
            return [whole, [x async for x in stream], plain]

    whole, chunks, plain = asyncio.run(run())
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and msg.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]  # fmt: skip
    ids = [c.id for c in msg.tool_calls]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}" if parser == "mistral" else r"call_\w+", i) for i in ids), ids
    streamed, calls, finish = from_stream(chunks)
    assert (streamed, finish) == (content or "", "tool_calls")
    assert [c["function"] for c in calls] == [c.function.model_dump() for c in msg.tool_calls]
    # tool_choice none: the same text is content, as written.
    assert plain.choices[0].message.content == output and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"
    assert_engine_idle_within(server, 5.0)


LESS_THAN = 44  # "<" in the default model's vocabulary: the hermes tag's first token, and no JSON value's


def test_auto_tools_with_a_response_format(server: Server):
    """tools (auto) and response_format together, as the OpenAI Agents SDK sends them: the answer is the format's
    JSON or the model's calls. A bias on "<" makes the small model begin a call; the grammar holds the rest."""
    answer = {"type": "object", "properties": {"sky": {"enum": ["sunny", "rainy"]}}, "required": ["sky"]}
    kw = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 96, "temperature": 0,
          "response_format": {"type": "json_schema", "json_schema": {"name": "weather", "schema": answer}}}

    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
            create, bias = c.chat.completions.create, {"logit_bias": {str(LESS_THAN): 100}}
            results = await asyncio.gather(create(**kw), create(**kw, **bias, parallel_tool_calls=False),
                                           create(**kw, **bias, parallel_tool_calls=False, stream=True))
            return [r if not isinstance(r, openai.AsyncStream) else [x async for x in r] for r in results]

    plain, whole, chunks = asyncio.run(run())
    if plain.choices[0].message.tool_calls is None:  # the model chose to answer: the format's JSON
        jsonschema.validate(json.loads(plain.choices[0].message.content), answer)
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and not msg.content and len(msg.tool_calls) == 1
    check_calls([c.model_dump() for c in msg.tool_calls], {"get_weather", "get_time"})
    content, calls, finish = from_stream(chunks)
    assert finish == "tool_calls" and content == ""
    assert [c["function"] for c in calls] == [c.function.model_dump() for c in msg.tool_calls]
    assert_engine_idle_within(server, 5.0)


FUNCTIONS = [t["function"] for t in TOOLS]  # the deprecated `functions` shape


def test_legacy_functions_answer_with_function_call(server: Server):
    """OpenAI's deprecated `functions` / `function_call`: a named function is forced as tool_choice would force it,
    and the call comes back as message.function_call (streamed: delta.function_call, the name first, then pieces of
    the arguments) with finish_reason "function_call"; auto with the hermes parser, through the same parser, and
    a history with a legacy call and its "function" result."""
    url = server.url + "/v1/chat/completions"
    body = {"model": MODEL, "messages": ASK, "functions": FUNCTIONS, "function_call": {"name": "get_time"},
            "max_tokens": 64, "temperature": 0}  # fmt: skip
    whole = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    msg = whole["message"]
    assert whole["finish_reason"] == "function_call" and "tool_calls" not in msg and msg["content"] is None
    assert msg["function_call"]["name"] == "get_time"
    jsonschema.validate(json.loads(msg["function_call"]["arguments"]), PARAMETERS["get_time"])
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    pieces = [d["function_call"] for d in deltas if "function_call" in d]
    assert pieces[0] == {"name": "get_time", "arguments": ""} and all(p.keys() == {"arguments"} for p in pieces[1:])
    assert "".join(p["arguments"] for p in pieces) == msg["function_call"]["arguments"]
    assert not any("tool_calls" in d for d in deltas) and chunks[-1]["choices"][0]["finish_reason"] == "function_call"

    regex = re.sub(r"([.{}\[\]])", r"\\\1", HERMES)
    auto = {**body, "function_call": "auto", "max_tokens": 128, "guided_regex": regex}
    called = httpx.post(url, json=auto, timeout=120).json()["choices"][0]
    assert called["finish_reason"] == "function_call" and called["message"]["function_call"] == {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}  # fmt: skip

    history = [*ASK, {"role": "assistant", "content": None, "function_call": {"name": "get_weather",
               "arguments": '{"city": "Paris", "days": 3}'}}, {"role": "function", "name": "get_weather",
               "content": "Sunny, 22 C"}]  # fmt: skip
    reply = httpx.post(url, json={**body, "messages": history, "function_call": "none", "max_tokens": 4}, timeout=120)
    alone = httpx.post(url, json={**body, "function_call": "none", "max_tokens": 4}, timeout=120)
    assert reply.status_code == alone.status_code == 200, reply.text
    # The call and its result are in the prompt (the template writes both).
    assert reply.json()["usage"]["prompt_tokens"] > alone.json()["usage"]["prompt_tokens"] + 20
    assert_engine_idle_within(server, 5.0)


BAD = [
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools", "object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}]},
     "tools", "JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(?<=x)"}}}}}], "tool_choice": "required"}, "tools", "json_schema"),
    ({"messages": [{"role": "tool", "content": "22 C"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]}, "messages",
     "arguments"),
    ({"functions": FUNCTIONS, "tools": TOOLS}, "functions", "not both"),
    ({"function_call": "auto"}, "function_call", "only allowed when functions"),
    ({"functions": FUNCTIONS, "function_call": {"name": "nope"}}, "function_call", "nope"),
    ({"functions": FUNCTIONS, "function_call": "required"}, "function_call", "function_call"),
    ({"messages": [{"role": "function", "content": "22 C"}]}, "messages", "name of the function"),
    ({"messages": [{"role": "user", "content": "hi", "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages", "only assistant messages"),
]


@pytest.mark.parametrize(("body", "param", "words"), BAD, ids=[f"{b[1]}-{b[2]}" for b in BAD])
def test_bad_tool_requests(server: Server, body, param, words):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"], error


def test_reasoning_parser_on_the_server(tool_servers: dict[str, Server]):
    """--reasoning-parser deepseek_r1: an answer that never closes its thinking (</think>) is all reasoning, so the
    default model's greedy answer, which has no tags, comes back whole in `reasoning` (whole and streamed) with empty
    content; a constrained answer is not split."""
    plain, thinking = tool_servers["hermes"], tool_servers["llama3_json"]  # the same model and template
    body = {"model": MODEL, "messages": ASK, "max_tokens": 24, "temperature": 0}
    expected = httpx.post(plain.url + "/v1/chat/completions", json=body, timeout=300).json()
    text = expected["choices"][0]["message"]["content"]
    assert text and "reasoning" not in expected["choices"][0]["message"]

    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=thinking.url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
            create = c.chat.completions.create
            json_body = {**body, "response_format": {"type": "json_object"}}
            whole, stream, constrained = await asyncio.gather(create(**body), create(**body, stream=True),
                                                              create(**json_body))  # fmt: skip
            return [whole, [x async for x in stream], constrained]

    whole, chunks, constrained = asyncio.run(run())
    msg = whole.choices[0].message
    assert msg.model_extra["reasoning"] == text and msg.content == ""
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == text
    assert "".join(d.content or "" for d in deltas) == ""
    assert constrained.choices[0].message.content.startswith("{")
    assert "reasoning" not in (constrained.choices[0].message.model_extra or {})
