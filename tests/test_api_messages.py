"""POST /v1/messages (Anthropic's Messages API, what Claude Code calls) with Anthropic's official client: whole and
streamed answers in Anthropic's event order against the same chat request, forced tool use and its result sent back,
stop sequences and the length limit as stop reasons, count_tokens, and errors in Anthropic's shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from frontend.api.serving_messages import _events
from frontend.engine.request_stream import Delta
from frontend.errors import ApiError
from tests.conftest import Server
from tests.test_api_responses import ASK, MODEL, chat
from tests.test_api_streaming import assert_engine_idle_within

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]},
                            "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}
TIME = {"name": "get_time", "description": "The time in a timezone",
        "input_schema": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}
TOOLS = [WEATHER, TIME]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["input_schema"]}} for t in TOOLS]  # fmt: skip
SYSTEM = "Answer in one sentence."
GREEDY = {"temperature": 0}  # the API's field; Anthropic's client no longer has an argument for it
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(tool_servers: dict[str, Server]) -> Server:
    return tool_servers["hermes"]


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def test_text_whole_and_streamed_equal_the_chat_answer(server: Server, client: anthropic.Anthropic) -> None:
    reference = chat(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], 40)
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 40, "system": SYSTEM, "extra_body": GREEDY,
                          "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    whole = client.messages.create(**kw)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == MODEL and [b.type for b in whole.content] == ["text"]
    assert whole.content[0].text == reference["choices"][0]["message"]["content"]
    finish = reference["choices"][0]["finish_reason"]
    assert whole.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[finish] and whole.stop_sequence is None
    prompt_tokens = reference["usage"]["prompt_tokens"]
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == prompt_tokens
    assert whole.usage.cache_read_input_tokens > 0  # the same prompt again: its whole blocks are cached
    assert whole.usage.output_tokens == reference["usage"]["completion_tokens"]

    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_stop",
                                                  "message_delta", "message_stop")]  # fmt: skip
    assert kinds == ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    pieces = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert len(pieces) > 3 and "".join(pieces) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def check_tool_use(block: Any, names: set[str]) -> None:
    assert block.type == "tool_use" and block.name in names and block.id
    jsonschema.validate(block.input, next(t["input_schema"] for t in TOOLS if t["name"] == block.name))


def test_forced_tool_use_and_its_result_sent_back(server: Server, client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "extra_body": GREEDY, "tools": TOOLS,
                          "messages": [{"role": "user", "content": ASK}]}  # fmt: skip
    anyone = client.messages.create(**kw, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert anyone.stop_reason == "tool_use" and len(anyone.content) == 1
    check_tool_use(anyone.content[0], {"get_weather", "get_time"})
    named = {"type": "tool", "name": "get_weather"}
    whole = client.messages.create(**kw, tool_choice=named)
    [call] = whole.content
    check_tool_use(call, {"get_weather"})

    with client.messages.stream(**kw, tool_choice=named) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [(b.type, b.name, b.input) for b in starts] == [("tool_use", "get_weather", {})]
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert json.loads("".join(pieces)) == call.input == final.content[0].input and final.stop_reason == "tool_use"

    # The call, as the client got it, and its result sent back: the chat request with the same tool messages.
    result = "Sunny, 22 C"
    back = client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, tools=TOOLS, messages=[
        {"role": "user", "content": ASK}, {"role": "assistant", "content": [call.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}])
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
                {"role": "tool", "tool_call_id": call.id, "content": result}]  # fmt: skip
    reference = chat(server, messages, 12, tools=CHAT_TOOLS)
    assert back.usage.input_tokens + back.usage.cache_read_input_tokens == reference["usage"]["prompt_tokens"]
    assert "".join(b.text for b in back.content if b.type == "text") == reference["choices"][0]["message"]["content"]
    counted = client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=[
        {"role": "user", "content": ASK}, {"role": "assistant", "content": [call.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}])
    assert counted.input_tokens == reference["usage"]["prompt_tokens"]


def test_stop_sequences_and_the_length_limit(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = {"model": MODEL, "extra_body": GREEDY, "messages": [{"role": "user", "content": QUESTION}]}
    text = client.messages.create(**kw, max_tokens=40).content[0].text
    word = text.split()[2]
    stopped = client.messages.create(**kw, max_tokens=40, stop_sequences=["zzqq", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert text.startswith(stopped.content[0].text) and word not in stopped.content[0].text
    short = client.messages.create(**kw, max_tokens=2)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    # A budget past the context is a ceiling, cut to the context (Claude Code asks for 32000 tokens)
    long = client.messages.create(**kw, max_tokens=32000, stop_sequences=[word])
    assert long.stop_reason == "stop_sequence" and long.content[0].text == stopped.content[0].text


@pytest.mark.parametrize(("body", "words"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens: Field required"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "content blocks of type 'image' are not supported"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]}, "server tools"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f"}]},
     "tools.0.input_schema: Field required"),
    ({"max_tokens": 5, "messages": []}, "messages is empty"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "tool"}},
     "tool_choice of type tool needs the tool's name"),
])  # fmt: skip
def test_bad_requests_are_400s_in_anthropics_shape(server: Server, body: dict, words: str) -> None:
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert words in r.json()["error"]["message"], r.json()


def test_the_client_raises_its_own_errors(client: anthropic.Anthropic, server: Server) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-nonexistent", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
    # Claude Code's user turns of roles "ctx" and "msg" are user turns
    turns = [{"role": "ctx", "content": "Context."}, {"role": "msg", "content": QUESTION}]
    assert client.messages.count_tokens(model=MODEL, messages=turns).input_tokens == client.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "Context."}, {"role": "user", "content": QUESTION}],
    ).input_tokens  # fmt: skip
    assert_engine_idle_within(server, 10)


def test_output_config_format_holds_the_answer_to_a_json_schema(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    answer = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Name a city as JSON."}], output_config={"format": {"type": "json_schema",
                                                                                        "schema": schema}})  # fmt: skip
    jsonschema.validate(json.loads(answer.content[0].text), schema)


def test_a_request_shaped_as_claude_codes_streams_to_the_end(server: Server) -> None:
    """What Claude Code sends: system blocks and a message block with cache_control, tools whose schemas name
    their JSON Schema draft, metadata, streaming, beta headers and fields this server does not know (ignored). (Its
    max_tokens of 32000, cut to the context, is test_stop_sequences_and_the_length_limit's: greedy, this answer would
    run to the context's end.)"""
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
              "properties": {"command": {"type": "string", "description": "The command to run"}},
              "required": ["command"]}  # fmt: skip
    body = {"model": MODEL, "max_tokens": 48, "stream": True, "temperature": 0,
            "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "List the files.",
                                                       "cache_control": {"type": "ephemeral"}}]}],
            "tools": [{"name": "Bash", "description": "Run a shell command", "input_schema": schema}],
            "metadata": {"user_id": "user_abc_account__session_1"}, "context_management": {"edits": []}}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=300,
                      headers={"anthropic-version": "2023-06-01", "anthropic-beta": "x"}) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert events[-2]["delta"]["stop_reason"] in ("end_turn", "tool_use", "max_tokens")
    assert events[-2]["usage"]["output_tokens"] > 0


def test_a_failure_after_the_stream_started_ends_it_with_an_error_event() -> None:
    """The events after an engine failure mid-answer (a poison request, say): the text so far, then Anthropic's
    error event, and no message_stop."""
    class Failing:  # a fan-out whose engine fails after one piece of text
        num_cached_tokens = 0

        async def deltas(self):
            yield 0, Delta(text="Hello")
            yield 0, Delta(finish_reason="error", error="the request crashed the engine core")

        def usage(self) -> dict:
            return {"prompt_tokens": 3, "completion_tokens": 1}

        def abort(self) -> None:
            self.aborted = True

    class Context:
        def failure(self, error: str, code: str | None) -> ApiError:
            return ApiError(500, error, None, code)

    async def collect(fan: Failing) -> list[dict]:
        chunks = [chunk async for chunk in _events(Context(), fan, None, {"id": "msg_1"}, [])]  # type: ignore[arg-type]
        return [json.loads(line[6:]) for c in chunks for line in c.decode().splitlines() if line.startswith("data: ")]

    fan = Failing()
    events = asyncio.run(collect(fan))
    assert [e["type"] for e in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert events[-1]["error"] == {"type": "api_error", "message": "the request crashed the engine core"}
    assert fan.aborted
