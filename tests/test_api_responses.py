"""POST /v1/responses (OpenAI's Responses API) with the official openai client: whole and streamed responses in
OpenAI's event order, item-list input and instructions against the same chat request, forced function calls and
their results sent back, text.format JSON schemas, max_output_tokens, client disconnects, and 400s."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import Server
from tests.test_api_streaming import assert_engine_idle_within

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}
TIME = {"type": "function", "name": "get_time", "description": "The time in a timezone",
        "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["name"]: t["parameters"] for t in TOOLS}
ASK = "What is the weather in Paris for the next 3 days?"
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added"]


@pytest.fixture(scope="module")
def server(tool_servers: dict[str, Server]) -> Server:
    return tool_servers["hermes"]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(server: Server, messages: list[dict[str, Any]], max_tokens: int, **kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_completion_tokens": max_tokens, "temperature": 0, **kw}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def events_of(stream: Any) -> list[Any]:
    """The stream's events, checking their sequence numbers count from 0."""
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_text_whole_and_streamed(client: openai.OpenAI):
    kw = {"model": MODEL, "input": "What is the capital of France?", "instructions": "Answer in one sentence.",
          "max_output_tokens": 40, "temperature": 0, "metadata": {"run": "test"}, "user": "u1"}
    whole = client.responses.create(**kw)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.status == "completed"
    assert whole.incomplete_details is None and whole.error is None and whole.model == MODEL
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and [p.type for p in message.content] == ["output_text"]
    assert message.content[0].annotations == [] and whole.output_text == message.content[0].text != ""
    usage = whole.usage
    assert usage.input_tokens > 10 and 0 < usage.output_tokens < 40
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
    # The request's settings, echoed as OpenAI does.
    assert (whole.instructions, whole.max_output_tokens, whole.temperature, whole.top_p) == (
        kw["instructions"], 40, 0, 1)  # fmt: skip
    assert (whole.metadata, whole.user, whole.tool_choice, whole.tools) == ({"run": "test"}, "u1", "auto", [])
    assert whole.parallel_tool_calls is True and whole.text.format.type == "text" and whole.store is True

    events = events_of(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", *TEXT_EVENTS,
                     *["response.output_text.delta"] * len(deltas), "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"]  # fmt: skip
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all((e.item_id, e.output_index, e.content_index) == (item_id, 0, 0) for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == events[-3].part.text == events[-2].item.content[0].text
    final = events[-1].response
    assert final.status == "completed" and final.output_text == text == whole.output_text  # greedy: the same
    assert final.output[0].id == item_id and final.usage.output_tokens == usage.output_tokens
    assert final.usage.input_tokens == usage.input_tokens


def test_item_list_input_equals_the_chat_request(server: Server, client: openai.OpenAI):
    items = [{"role": "developer", "content": "You are terse."},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue.",
                                                                   "annotations": []}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Another "},
                                          {"type": "input_text", "text": "one, please."}]}]  # fmt: skip
    messages = [{"role": "system", "content": "Be kind."}, {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another one, please."}]  # fmt: skip
    r = client.responses.create(model=MODEL, input=items, instructions="Be kind.", max_output_tokens=24,
                                temperature=0)  # fmt: skip
    reference = chat(server, messages, 24)
    assert r.output_text == reference["choices"][0]["message"]["content"] != ""
    assert r.usage.input_tokens == reference["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == reference["usage"]["completion_tokens"]
    plain = client.responses.create(model=MODEL, input="Write a haiku about the sea.", max_output_tokens=24,
                                    temperature=0)  # fmt: skip
    reference = chat(server, [{"role": "user", "content": "Write a haiku about the sea."}], 24)
    assert plain.output_text == reference["choices"][0]["message"]["content"]


def test_reasoning_items_with_a_reasoning_parser(client: openai.OpenAI, tool_servers: dict[str, Server]):
    """--reasoning-parser deepseek_r1 (the llama3_json tool server): the default model's answer, which never closes a
    <think>, is all reasoning, so it comes back as one `reasoning` item holding the plain server's text (whole and
    streamed); sent back as input, that item stays out of the prompt."""
    kw = {"model": MODEL, "input": "Write a haiku about the sea.", "max_output_tokens": 24, "temperature": 0}
    text = client.responses.create(**kw).output_text
    thinking = openai.OpenAI(base_url=tool_servers["llama3_json"].url + "/v1", api_key="x", max_retries=0,
                             timeout=300)  # fmt: skip
    whole = thinking.responses.create(**kw)
    [item] = whole.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.status == "completed"
    assert [(c.type, c.text) for c in item.content] == [("reasoning_text", text)] and item.summary == []
    assert whole.output_text == ""

    events = events_of(thinking.responses.create(**kw, stream=True))
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        *["response.reasoning_text.delta"] * len(deltas),
                                        "response.reasoning_text.done", "response.output_item.done",
                                        "response.completed"]  # fmt: skip
    assert "".join(e.delta for e in deltas) == events[-3].text == text
    assert events[-1].response.output[0].content[0].text == text

    turn = [{"role": "user", "content": "Write a haiku about the sea."}, item.model_dump(exclude_none=True),
            {"role": "user", "content": "Another one."}]  # fmt: skip
    without = [turn[0], turn[2]]
    sent = [thinking.responses.create(model=MODEL, input=i, max_output_tokens=1) for i in (turn, without)]
    assert sent[0].usage.input_tokens == sent[1].usage.input_tokens


def check_call(item: Any, names: set[str]) -> None:
    assert item.type == "function_call" and item.status == "completed" and item.name in names
    assert item.id.startswith("fc_") and item.call_id.startswith("call_")
    jsonschema.validate(json.loads(item.arguments), PARAMETERS[item.name])


def test_forced_function_call_and_its_result_sent_back(server: Server, client: openai.OpenAI):
    kw = {"model": MODEL, "input": ASK, "tools": TOOLS, "max_output_tokens": 64, "temperature": 0}
    required = client.responses.create(**kw, tool_choice="required", parallel_tool_calls=False)
    assert required.status == "completed" and len(required.output) == 1 and required.parallel_tool_calls is False
    check_call(required.output[0], {"get_weather", "get_time"})
    named = {"type": "function", "name": "get_weather"}
    whole = client.responses.create(**kw, tool_choice=named)
    [call] = whole.output
    check_call(call, {"get_weather"})
    assert whole.tool_choice.name == "get_weather" and [t.name for t in whole.tools] == ["get_weather", "get_time"]

    events = events_of(client.responses.create(**kw, tool_choice=named, stream=True))
    pieces = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        *[p.type for p in pieces], "response.function_call_arguments.done",
                                        "response.output_item.done", "response.completed"]  # fmt: skip
    added, done, item_done = events[2].item, events[-3], events[-2].item
    assert added.type == "function_call" and added.arguments == "" and added.status == "in_progress"
    assert all(p.item_id == added.id and p.output_index == 0 for p in pieces)
    assert "".join(p.delta for p in pieces) == done.arguments == item_done.arguments == call.arguments  # greedy
    assert item_done.call_id == added.call_id and events[-1].response.output[0].arguments == call.arguments

    # The call (as the client got it) and its result, sent back: the chat request with the same tool messages.
    result = "Sunny, 22 C"
    back = client.responses.create(model=MODEL, tools=TOOLS, max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": ASK}, *whole.output,
        {"type": "function_call_output", "call_id": call.call_id, "output": result}])  # fmt: skip
    chat_tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                  for t in TOOLS]  # fmt: skip
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": result}]  # fmt: skip
    reference = chat(server, messages, 12, tools=chat_tools)
    assert back.usage.input_tokens == reference["usage"]["prompt_tokens"] > required.usage.input_tokens + 20
    assert back.output_text == (reference["choices"][0]["message"]["content"] or "")


def test_text_format_json_schema_and_json_object(client: openai.OpenAI):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
              "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
              "required": ["city", "population"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "name": "city", "schema": schema, "strict": True}
    r = client.responses.create(model=MODEL, input="Describe Paris as JSON.", text={"format": fmt},
                                max_output_tokens=64, temperature=0)  # fmt: skip
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "city" and r.text.format.schema_ == schema
    r = client.responses.create(model=MODEL, input="Describe Paris as JSON.", max_output_tokens=64, temperature=0,
                                text={"format": {"type": "json_object"}})  # fmt: skip
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


def test_max_output_tokens_leaves_the_response_incomplete(client: openai.OpenAI):
    kw = {"model": MODEL, "input": "Tell me a long story about a dragon.", "max_output_tokens": 3, "temperature": 0}
    r = client.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete" and r.output_text
    events = events_of(client.responses.create(**kw, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == r.output_text
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"


def test_disconnect_aborts_the_engine_request(server: Server):
    """A long generation (a 1500-character string, by the schema) whose client leaves after a few deltas."""
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 1500}}, "required": ["story"]}
    body = {"model": MODEL, "input": "Tell me about the sea.", "max_output_tokens": 1800, "stream": True,
            "text": {"format": {"type": "json_schema", "name": "story", "schema": schema}}}  # fmt: skip
    deltas = 0
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "response.output_text.delta":
                deltas += 1
                if deltas == 5:
                    break
    assert deltas == 5
    assert_engine_idle_within(server, 5.0)


def test_explicit_nulls_mean_the_default(server: Server):
    """Clients send null for options left unset, and a message item's type may be null as well as absent."""
    nullable = ["instructions", "temperature", "top_p", "seed", "tools", "tool_choice", "parallel_tool_calls", "text",
                "stream", "metadata", "user", "store", "previous_response_id", "conversation", "background",
                "reasoning", "include", "truncation"]  # fmt: skip
    body = {"model": None, "input": [{"type": None, "role": "user", "content": "hi"}], "max_output_tokens": 1,
            **dict.fromkeys(nullable)}  # fmt: skip
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["status"] == "incomplete" and answer["usage"]["output_tokens"] == 1
    assert (answer["tool_choice"], answer["text"], answer["metadata"]) == ("auto", {"format": {"type": "text"}}, {})


BAD = [
    ({"previous_response_id": "resp_123"}, "previous_response_id", "Previous response with id 'resp_123' not found"),
    ({"conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation", "not both"),
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search' are not supported"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["x"]}]}, "tools", "'file_search'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input",
     "'input_image' are not supported"),
    ({"input": [{"type": "input_file", "file_id": "f"}]}, "input", "'input_file' are not supported"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input", "arguments"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "role"),
    ({"input": ["hi"]}, "input", "objects"),
    ({"input": []}, "input", "input is empty"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "not supported"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs a schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}}, "text",
     "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"truncation": "middle"}, "truncation", "'auto' or 'disabled'"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "stored prompt template"),
    ({"top_logprobs": 3}, "top_logprobs", "/v1/chat/completions gives them"),
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include", "not served"),
    ({"max_output_tokens": 5000}, "max_output_tokens", "maximum context length"),
    ({"temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16"),
    ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools", "pattern"),
    ({"model": "gpt-4o"}, "model", "does not exist"),
    # Echoed in the response, so never taken in with text that cannot be encoded.
    ({"metadata": {"\ud800": "v"}}, "metadata", "not valid Unicode"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "description": "\ud800"}}}},
     "text", "surrogates not allowed"),
]


@pytest.mark.parametrize(("body", "param", "words"), BAD, ids=[f"{b[1]}-{b[2][:24]}" for b in BAD])
def test_bad_requests(server: Server, body: dict[str, Any], param: str, words: str):
    raw = json.dumps({"model": MODEL, "input": "hi", **body})  # ASCII: a lone surrogate as its JSON escape
    r = httpx.post(server.url + "/v1/responses", content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"], error
