"""Stored responses (frontend/api/responses_store.py): previous_response_id continues a stored response exactly as
the chat request holding the whole conversation would (text turns, a function call and its result, a streamed turn),
GET /v1/responses/{id} and its input_items return what was stored, DELETE forgets it; store false keeps nothing;
background responses are polled and cancelled; the
store's memory bound evicts the least recently used responses, never an ancestor before the responses continuing it."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from frontend.api.protocol_responses import ResponsesRequest, refuse_state
from frontend.api.responses_store import ResponseStore
from frontend.errors import ApiError
from tests.conftest import Server
from tests.test_api_responses import ASK, MODEL, TOOLS, chat, events_of
from tests.test_api_streaming import assert_engine_idle_within


def test_turns_continue_the_stored_conversation(hermes_server: Server, hermes_client: openai.OpenAI):
    server, client = hermes_server, hermes_client
    first = client.responses.create(model=MODEL, input="Name a colour.", instructions="Be terse.",
                                    max_output_tokens=16, temperature=0)  # fmt: skip
    assert first.store is True and first.previous_response_id is None and first.output_text != ""
    second = client.responses.create(model=MODEL, input="Another one, please.", previous_response_id=first.id,
                                     instructions="Be kind.", max_output_tokens=16, temperature=0)  # fmt: skip
    assert second.previous_response_id == first.id
    # The first turn's instructions are not carried over (as OpenAI's are not); the second's come first.
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "Another one, please."}]  # fmt: skip
    reference = chat(server, messages, 16)
    assert second.output_text == reference["choices"][0]["message"]["content"]
    assert second.usage.input_tokens == reference["usage"]["prompt_tokens"]

    # A streamed turn is stored too, as its last event gave it; GET returns the response as it was returned.
    events = events_of(client.responses.create(model=MODEL, input=[{"role": "user", "content": "And a third?"}],
                                               previous_response_id=second.id, max_output_tokens=16,
                                               temperature=0, stream=True))  # fmt: skip
    third = events[-1].response
    reference = chat(server, [*messages[1:], {"role": "assistant", "content": second.output_text},
                              {"role": "user", "content": "And a third?"}], 16)  # fmt: skip
    assert third.output_text == reference["choices"][0]["message"]["content"]
    assert client.responses.retrieve(third.id).model_dump() == third.model_dump()
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()

    # input_items: the conversation the response was made from, newest first by default, each item with an id.
    listed = httpx.get(f"{server.url}/v1/responses/{third.id}/input_items", params={"order": "asc", "limit": 100})
    data = listed.json()["data"]
    texts = [(i["type"], i.get("role"), "".join(p["text"] for p in i["content"])) for i in data]
    assert texts == [("message", "user", "Name a colour."), ("message", "assistant", first.output_text),
                     ("message", "user", "Another one, please."), ("message", "assistant", second.output_text),
                     ("message", "user", "And a third?")]  # fmt: skip
    assert data[1]["id"] == first.output[0].id and len({i["id"] for i in data}) == 5
    page = client.responses.input_items.list(third.id, limit=2)
    assert [i.id for i in page.data] == [data[4]["id"], data[3]["id"]] and page.has_more
    after = client.responses.input_items.list(third.id, limit=2, after=data[3]["id"], order="desc")
    assert [i.id for i in after.data] == [data[2]["id"], data[1]["id"]]

    # Deleted: gone from GET, and the responses continuing it can no longer be continued.
    assert httpx.delete(f"{server.url}/v1/responses/{first.id}").json() == {
        "id": first.id, "object": "response", "deleted": True}  # fmt: skip
    for method in ("GET", "DELETE"):
        gone = httpx.request(method, f"{server.url}/v1/responses/{first.id}")
        assert gone.status_code == 404 and first.id in gone.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="More?", previous_response_id=third.id, max_output_tokens=4)
    error = refused.value.body
    assert (error["code"], error["param"]) == ("previous_response_not_found", "previous_response_id")
    assert first.id in error["message"]
    assert len(client.responses.input_items.list(third.id, order="asc").data) == 3  # what is left of the chain


def test_response_ids_are_the_servers_whatever_x_request_id_says(hermes_server: Server):
    """A client's X-Request-Id (a proxy may send the same one twice) never names a stored response: the second
    request with the same header, continuing the first, had replaced it with a response that continued itself, and
    the next walk of that chain never ended (the API process hung)."""
    server = hermes_server
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    headers = {"X-Request-Id": "same"}
    first = httpx.post(f"{server.url}/v1/responses", json=body, headers=headers, timeout=60).json()
    second = httpx.post(f"{server.url}/v1/responses", json={**body, "previous_response_id": first["id"]},
                        headers=headers, timeout=60).json()  # fmt: skip
    third = httpx.post(f"{server.url}/v1/responses", json={**body, "previous_response_id": second["id"]},
                       headers=headers, timeout=60)  # fmt: skip
    assert third.status_code == 200 and len({first["id"], second["id"], third.json()["id"]}) == 3
    assert third.headers["x-request-id"] == "same"
    items = httpx.get(f"{server.url}/v1/responses/{third.json()['id']}/input_items", timeout=10).json()["data"]
    assert len(items) == 5  # two turns of input and output, then its own input


def test_a_function_call_continued_with_its_result(hermes_server: Server, hermes_client: openai.OpenAI):
    server, client = hermes_server, hermes_client
    call_turn = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, max_output_tokens=64, temperature=0,
                                        tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    [call] = call_turn.output
    back = client.responses.create(model=MODEL, tools=TOOLS, max_output_tokens=12, temperature=0,
                                   previous_response_id=call_turn.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 22 C"}])  # fmt: skip
    chat_tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                  for t in TOOLS]  # fmt: skip
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 22 C"}]  # fmt: skip
    reference = chat(server, messages, 12, tools=chat_tools)
    assert back.usage.input_tokens == reference["usage"]["prompt_tokens"]
    assert back.output_text == (reference["choices"][0]["message"]["content"] or "")


def test_store_false_keeps_nothing(hermes_server: Server, hermes_client: openai.OpenAI):
    server, client = hermes_server, hermes_client
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False, top_logprobs=0,
                                include=["reasoning.encrypted_content"])  # asks for nothing this server has
    assert r.store is False
    assert httpx.get(f"{server.url}/v1/responses/{r.id}").status_code == 404
    with pytest.raises(openai.BadRequestError, match="previous_response_not_found|not found"):
        client.responses.create(model=MODEL, input="More?", previous_response_id=r.id, max_output_tokens=2)
    bad = httpx.get(f"{server.url}/v1/responses/{r.id}/input_items", params={"limit": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def poll(client: openai.OpenAI, rid: str, seconds: float) -> Any:
    start = time.monotonic()
    while (r := client.responses.retrieve(rid)).status == "in_progress":
        assert time.monotonic() - start < seconds, f"{rid} still in progress after {seconds} s"
        time.sleep(0.1)
    return r


def test_background_responses_are_polled_and_cancelled(hermes_server: Server, hermes_client: openai.OpenAI):
    server, client = hermes_server, hermes_client
    kw = {"model": MODEL, "input": "Name three colours.", "max_output_tokens": 24, "temperature": 0}
    started = client.responses.create(**kw, background=True)
    assert (started.status, started.background, started.output) == ("in_progress", True, [])
    done = poll(client, started.id, 120)
    assert done.status in ("completed", "incomplete") and done.background is True
    assert done.output_text == client.responses.create(**kw).output_text != ""  # greedy: the same text

    # A response whose grammar holds it to 400 numbers runs long enough to be cancelled while in progress.
    many = {"type": "json_schema", "name": "many", "schema": {"type": "array", "minItems": 400,
                                                             "items": {"type": "integer"}}}  # fmt: skip
    long = client.responses.create(model=MODEL, input="Numbers:", max_output_tokens=2000, text={"format": many},
                                   background=True)  # fmt: skip
    cancelled = httpx.post(f"{server.url}/v1/responses/{long.id}/cancel", timeout=30).json()
    assert cancelled["status"] == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    again = httpx.post(f"{server.url}/v1/responses/{long.id}/cancel", timeout=30)
    assert again.status_code == 400 and "cancelled" in again.json()["error"]["message"]
    assert_engine_idle_within(server, 10)  # the engine's request was aborted, its blocks freed
    deleted = client.responses.create(model=MODEL, input="Numbers:", max_output_tokens=2000, text={"format": many},
                                      background=True)  # fmt: skip
    client.responses.delete(deleted.id)  # deleting a running response cancels it
    assert_engine_idle_within(server, 10)
    refused = httpx.post(f"{server.url}/v1/responses", json={**kw, "background": True, "store": False}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "background"


def sse_events(lines: Any, count: int | None = None) -> list[dict[str, Any]]:
    """The events of an SSE response's lines (the first `count` of them, or all)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            events.append(json.loads(line[6:]))
            if len(events) == count:
                break
    return events


def test_a_streamed_background_response_is_resumed_where_its_client_left(hermes_server: Server):
    many = {"type": "json_schema", "name": "many", "schema": {"type": "array", "minItems": 100,
                                                             "items": {"type": "integer"}}}  # fmt: skip
    body = {"model": MODEL, "input": "Numbers:", "max_output_tokens": 300, "text": {"format": many},
            "background": True, "stream": True}  # fmt: skip
    url = f"{hermes_server.url}/v1/responses"
    with httpx.stream("POST", url, json=body, timeout=60) as r:  # the client leaves after five events
        first = sse_events(r.iter_lines(), 5)
    rid = first[0]["response"]["id"]
    assert [e["sequence_number"] for e in first] == list(range(5)) and first[0]["response"]["background"] is True
    with httpx.stream("GET", f"{url}/{rid}", params={"stream": "true", "starting_after": 4}, timeout=120) as r:
        rest = sse_events(r.iter_lines())
    events = first + rest
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = httpx.get(f"{url}/{rid}", timeout=10).json()
    assert final == events[-1]["response"] and final["output"][0]["content"][0]["text"] == text
    over = httpx.get(f"{url}/{rid}", params={"stream": "true"}, timeout=10)  # over: no stream to resume
    assert over.status_code == 400 and over.json()["error"]["param"] == "stream"


def stored(store: ResponseStore, rid: str, text: str, previous: str | None = None) -> None:
    store.put(rid, {"id": rid, "output": [{"type": "message", "role": "assistant", "content": text}]},
              [{"type": "message", "role": "user", "content": text}], previous)  # fmt: skip


def test_the_store_keeps_to_its_bound_and_never_drops_an_ancestor_first():
    one = ResponseStore(1 << 20)
    stored(one, "r", "x" * 1000)
    size = one.bytes
    store = ResponseStore(4 * size + size // 2)  # room for four responses of this size
    stored(store, "a", "x" * 1000)
    stored(store, "b", "y" * 1000, previous="a")
    stored(store, "other", "z" * 1000)
    stored(store, "c", "w" * 1000, previous="b")  # refreshes b and a after c: they are now the last to go
    stored(store, "d", "v" * 1000)  # one over the bound: `other`, used least recently, goes
    assert len(store) == 4 and store.bytes <= store.max_bytes
    with pytest.raises(ApiError):
        store.get("other")
    texts = [item["content"] for item in store.conversation("c")]
    assert texts == ["x" * 1000] * 2 + ["y" * 1000] * 2 + ["w" * 1000] * 2
    stored(store, "e", "u" * 1000)  # d goes next, then c, before any of c's ancestors
    stored(store, "f", "t" * 1000)
    assert {rid for rid in "abcdef" if rid in store._entries} == {"a", "b", "e", "f"}
    assert store.delete("a") and not store.delete("a") and store.bytes == 3 * size
    with pytest.raises(ApiError, match="'a' not found"):
        store.conversation("b")
    stored(store, "huge", "s" * 5 * 1000)  # larger than the whole store: not kept, and nothing else lost for it
    assert len(store) == 3 and "huge" not in store._entries


def test_no_store_refuses_previous_response_id():
    req = ResponsesRequest(input="hi", previous_response_id="resp_1")
    with pytest.raises(ApiError, match="--responses-store-mib 0") as refused:
        refuse_state(req, keeps_responses=False)
    assert refused.value.param == "previous_response_id"
    refuse_state(req, keeps_responses=True)  # kept: looked up in the store instead
