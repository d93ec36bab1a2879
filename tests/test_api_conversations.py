"""The Conversations API (frontend/api/conversations.py) with the official openai client: a conversation's items,
created, listed, added, read and deleted; /v1/responses naming a conversation answers as the chat request holding
its items and then the input, and adds the turn to it; 404s and 400s; the memory bound."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from frontend.api.conversations import ConversationStore, CreateConversation
from frontend.errors import ApiError
from tests.conftest import Server
from tests.test_api_responses import MODEL, chat


def texts(items: list) -> list[tuple[str, str]]:
    return [(i.role, "".join(p.text for p in i.content)) for i in items]


def test_responses_continue_a_conversation_and_add_their_turns(hermes_server: Server, hermes_client: openai.OpenAI):
    server, client = hermes_server, hermes_client
    conv = client.conversations.create(items=[{"role": "developer", "content": "Be terse."},
                                              {"role": "user", "content": "Name a colour."}],
                                       metadata={"topic": "colours"})  # fmt: skip
    assert conv.id.startswith("conv_") and conv.object == "conversation" and conv.metadata == {"topic": "colours"}
    assert client.conversations.retrieve(conv.id).model_dump() == conv.model_dump()
    assert client.conversations.update(conv.id, metadata={"topic": "c2"}).metadata == {"topic": "c2"}

    first = client.responses.create(model=MODEL, conversation=conv.id, input="Another one?", max_output_tokens=16,
                                    temperature=0)  # fmt: skip
    assert first.conversation.id == conv.id
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."},
                {"role": "user", "content": "Another one?"}]  # fmt: skip
    reference = chat(server, messages, 16)
    assert first.output_text == reference["choices"][0]["message"]["content"] != ""
    assert first.usage.input_tokens == reference["usage"]["prompt_tokens"]
    items = client.conversations.items.list(conv.id, order="asc").data
    assert texts(items) == [("developer", "Be terse."), ("user", "Name a colour."), ("user", "Another one?"),
                            ("assistant", first.output_text)]  # fmt: skip
    assert items[3].id == first.output[0].id

    # A streamed turn, naming the conversation as an object, continues it the same way.
    stream = client.responses.create(model=MODEL, conversation={"id": conv.id}, input="And a third?",
                                     max_output_tokens=16, temperature=0, stream=True)  # fmt: skip
    second = list(stream)[-1].response
    reference = chat(server, [*messages, {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "And a third?"}], 16)  # fmt: skip
    assert second.output_text == reference["choices"][0]["message"]["content"]
    newest = client.conversations.items.list(conv.id, limit=2)
    assert texts(newest.data) == [("assistant", second.output_text), ("user", "And a third?")] and newest.has_more

    # Items added, read and deleted by the client.
    added = client.conversations.items.create(conv.id, items=[{"role": "user", "content": "One"},
                                                              {"role": "assistant", "content": "Two"}])  # fmt: skip
    assert texts(added.data) == [("user", "One"), ("assistant", "Two")]
    one = client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    assert one.id == added.data[0].id and texts([one]) == [("user", "One")]
    assert client.conversations.items.delete(added.data[0].id, conversation_id=conv.id).id == conv.id
    assert texts(client.conversations.items.list(conv.id, limit=1).data) == [("assistant", "Two")]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)

    with pytest.raises(openai.BadRequestError) as both:
        client.responses.create(model=MODEL, conversation=conv.id, previous_response_id=first.id, input="x")
    assert both.value.body["param"] == "conversation"
    assert httpx.delete(f"{server.url}/v1/conversations/{conv.id}").json() == {
        "id": conv.id, "object": "conversation.deleted", "deleted": True}  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, conversation=conv.id, input="Hello?", max_output_tokens=2)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, "items"),
    ("/v1/conversations", {"items": [{"type": "input_image"}]}, "items"),
    ("/v1/conversations", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
])  # fmt: skip
def test_bad_conversation_requests(hermes_server: Server, path: str, body: dict, param: str):
    server = hermes_server
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_store_keeps_to_its_bound():
    store = ConversationStore(10_000)
    old = store.create(CreateConversation(items=[{"role": "user", "content": "x" * 3000}]))
    new = store.create(CreateConversation(items=[{"role": "user", "content": "y" * 3000}]))
    store.get(old.id)  # used: `new` is now the least recently used
    store.add(old.id, [{"type": "message", "role": "user", "content": "z" * 5000}])
    assert old.id in store and new.id not in store and store.bytes == old.size <= 10_000
    store.remove_item(old.id, old.items[0]["id"])
    assert store.bytes == old.size == len(json.dumps(old.items[0]))
    with pytest.raises(ApiError, match="not kept"):
        ConversationStore(0).create(CreateConversation())


def test_truncation_auto_drops_the_oldest_items_that_do_not_fit(hermes_server: Server, hermes_client: openai.OpenAI):
    """A conversation past the context (20 items of ~900 tokens): without truncation the request is a 400; with
    truncation auto the fewest oldest items are dropped, as /tokenize measures the prompts they would make."""
    server, client = hermes_server, hermes_client
    context = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    items = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"item{i} " * 300} for i in range(20)]
    conv = client.conversations.create(items=items)
    kw = {"model": MODEL, "conversation": conv.id, "input": "Summarize.", "max_output_tokens": 8, "temperature": 0}
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.responses.create(**kw)
    r = client.responses.create(**kw, truncation="auto")
    assert r.truncation == "auto" and r.status in ("completed", "incomplete")
    turn = [*items, {"role": "user", "content": "Summarize."}]

    def prompt_tokens(dropped: int) -> int:
        body = {"model": MODEL, "messages": turn[dropped:], "add_generation_prompt": True}
        return httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["count"]

    kept = next(k for k in range(len(turn)) if prompt_tokens(k) <= context - 8)
    assert kept > 0 and r.usage.input_tokens == prompt_tokens(kept) > context - 8 - 1000
    assert len(client.conversations.items.list(conv.id, limit=100).data) == 22  # the conversation keeps them all
    # A lone input too long for the context: the usual 400, not one about an empty input.
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.responses.create(model=MODEL, input="word " * 3 * context, max_output_tokens=8, truncation="auto")
