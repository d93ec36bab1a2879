"""vLLM's request extras over HTTP: truncate_prompt_tokens, priority (and its policy), allowed_token_ids, bad_words,
return_tokens_as_token_ids, chat_template_kwargs, add_special_tokens; chat logprobs' bytes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import Server
from tests.test_api_compat import CHAT, CMPL, HI, MODEL, post, stream


def test_truncate_prompt_tokens_keeps_the_prompts_end(server: Server):
    ids = post(server, "/tokenize", {"prompt": "Once upon a time, there was a dragon who lived alone"}).json()["tokens"]
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "echo": True, "truncate_prompt_tokens": 4}
    r = post(server, CMPL, body).json()
    kept = post(server, "/detokenize", {"tokens": ids[-4:]}).json()["prompt"]
    assert r["usage"]["prompt_tokens"] == 4 and r["choices"][0]["text"].startswith(kept), r
    as_text = post(server, CMPL, {**body, "prompt": post(server, "/detokenize", {"tokens": ids}).json()["prompt"]})
    assert as_text.json()["choices"][0]["text"] == r["choices"][0]["text"]  # echoed: the kept part, not the whole
    whole = post(server, CHAT, {"messages": HI, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    chat = post(server, CHAT, {"messages": HI, "max_tokens": 1, "truncate_prompt_tokens": 3}).json()
    assert chat["usage"]["prompt_tokens"] == 3 < whole, chat
    r = post(server, CMPL, {**body, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_priority_needs_the_priority_policy(server: Server):
    """As vLLM: a priority the scheduler would ignore is refused."""
    assert post(server, CHAT, {"messages": HI, "max_tokens": 1, "priority": 0}).status_code == 200
    r = post(server, CHAT, {"messages": HI, "max_tokens": 1, "priority": -3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert "--scheduling-policy priority" in r.json()["error"]["message"]
    r = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 1, "priority": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text


def test_allowed_token_ids_hold_every_token(server: Server):
    """vLLM's allowed_token_ids: sampled at temperature 1, every token is one of them (their logprobs' tokens say
    which); an id outside the vocabulary and an empty list are 400s."""
    allowed = post(server, "/tokenize", {"prompt": " cat dog bird", "add_special_tokens": False}).json()["tokens"]
    texts = {post(server, "/detokenize", {"tokens": [t]}).json()["prompt"] for t in allowed}
    body = {"prompt": "Name an animal:", "max_tokens": 12, "temperature": 1, "ignore_eos": True, "logprobs": 0,
            "allowed_token_ids": allowed, "n": 3, "seed": 1}  # fmt: skip
    r = post(server, CMPL, body).json()
    tokens = [t for c in r["choices"] for t in c["logprobs"]["tokens"]]
    assert len(tokens) == 36 and set(tokens) <= texts, (tokens, texts)
    chat = post(server, CHAT, {"messages": HI, "max_tokens": 6, "ignore_eos": True, "allowed_token_ids": allowed[:1],
                               "temperature": 0}).json()  # fmt: skip
    assert chat["choices"][0]["message"]["content"] == post(server, "/detokenize", {"tokens": allowed[:1] * 6}).json()[
        "prompt"]  # fmt: skip
    for bad in ([], [10**6]):
        r = post(server, CMPL, {**body, "allowed_token_ids": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


def test_allowed_token_ids_may_repeat_past_the_vocabulary(server: Server):
    """A mask, as vLLM's: an id given 65536 times (more ids than SmolLM's 49152-token vocabulary) is one id, not an
    engine error (a 500, or an error event in a stream)."""
    one = post(server, "/tokenize", {"prompt": " cat", "add_special_tokens": False}).json()["tokens"]
    assert len(one) == 1
    body = {"prompt": "Name an animal:", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "allowed_token_ids": one * (1 << 16)}  # fmt: skip
    r = post(server, CMPL, body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " cat" * 3, r.text
    chunks = stream(server, CHAT, {"messages": HI, **{k: body[k] for k in ("max_tokens", "allowed_token_ids")}})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == " cat" * 3


def test_bad_words_never_appear_as_their_tokens(server: Server):
    """vLLM's bad_words: the greedy answer's first word, banned, is gone from the answer's tokens (as it would begin
    the text and after a space), and the answer changes; an empty word is a 400."""
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True}  # fmt: skip
    plain = post(server, CMPL, body).json()["choices"][0]
    word = plain["text"].split()[0]
    banned = post(server, CMPL, {**body, "bad_words": [word]}).json()["choices"][0]
    assert banned["text"] != plain["text"], banned
    outputs = [int(t.removeprefix("token_id:")) for t in banned["logprobs"]["tokens"]]
    for text in (word, " " + word):
        ids = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert not any(outputs[i : i + len(ids)] == ids for i in range(len(outputs))), (text, ids, outputs)
    r = post(server, CMPL, {**body, "bad_words": ["  "]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server: Server):
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:{id}" (chosen and top alike); the text
    and its offsets are unchanged."""
    prompt = "The capital of France is"
    ids = post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}
    plain = post(server, CMPL, body).json()["choices"][0]
    named = post(server, CMPL, {**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    lp, plain_lp = named["logprobs"], plain["logprobs"]
    assert named["text"] == plain["text"] and lp["text_offset"] == plain_lp["text_offset"]
    assert lp["tokens"][: len(ids)] == [f"token_id:{t}" for t in ids]
    outputs = [int(t.removeprefix("token_id:")) for t in lp["tokens"][len(ids) :]]
    assert post(server, "/detokenize", {"tokens": outputs}).json()["prompt"] == plain["text"][len(prompt) :]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"][1:] for k in top)
    chat = {"messages": HI, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 1}
    named_chat = post(server, CHAT, {**chat, "return_tokens_as_token_ids": True}).json()
    content = named_chat["choices"][0]["logprobs"]["content"]
    plain_content = post(server, CHAT, chat).json()["choices"][0]["logprobs"]["content"]
    assert [e["bytes"] for e in content] == [e["bytes"] for e in plain_content]
    assert all(e["token"].startswith("token_id:") and e["top_logprobs"][0]["token"] == e["token"] for e in content)


@pytest.fixture(scope="module")
def priority_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("priority"), "--scheduling-policy", "priority", "--max-num-seqs", "1")
    yield s.wait_healthy()
    s.assert_clean_exit()


def test_priority_orders_the_queue(priority_server: Server):
    """With one request running (--max-num-seqs 1), of two that queue behind it the lower priority value runs first,
    though it came last (a /v1/responses request: its priority takes the chat path)."""
    body = {"model": MODEL, "messages": HI, "temperature": 0, "ignore_eos": True}

    async def run() -> list[str]:
        done: list[str] = []
        async with httpx.AsyncClient(base_url=priority_server.url, timeout=120) as client:
            async def finish(name: str, path: str, request: dict) -> None:
                r = await client.post(path, json={"model": MODEL, **request})
                assert r.status_code == 200, r.text
                done.append(name)

            async with client.stream("POST", CHAT, json={**body, "max_tokens": 64, "stream": True}) as first:
                lines = first.aiter_lines()
                while not (await anext(lines)).startswith("data: "):  # running: it holds the one slot
                    pass
                late = asyncio.ensure_future(finish("late", CHAT, {**body, "max_tokens": 8, "priority": 5}))
                await asyncio.sleep(0.2)
                urgent = asyncio.ensure_future(finish("urgent", "/v1/responses", {"input": "hi", "max_output_tokens": 8,
                                                                                  "priority": -5}))  # fmt: skip
                async for _ in lines:
                    pass
            done.append("first")
            await asyncio.gather(late, urgent)
        return done

    assert asyncio.run(run()) == ["first", "urgent", "late"]


def test_chat_template_kwargs_may_not_replace_the_servers_variables(server: Server):
    ok = post(server, CHAT, {"messages": HI, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200, ok.text
    r = post(server, CHAT, {"messages": HI, "max_tokens": 1, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_add_special_tokens_is_read_on_both_routes(server: Server):
    """vLLM's add_special_tokens is a field of both routes (the default model adds no BOS, so the prompt is the
    same either way; tests/test_add_special_tokens.py checks the ids with one that does), not an ignored extra."""
    for path, body in ((CMPL, {"prompt": "Hello"}), (CHAT, {"messages": HI})):
        answers = [post(server, path, {**body, "max_tokens": 1, "add_special_tokens": add}) for add in (True, False)]
        counts = {r.json()["usage"]["prompt_tokens"] for r in answers}
        assert len(counts) == 1, counts
        r = post(server, path, {**body, "max_tokens": 1, "add_special_tokens": "sometimes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens", r.text


def test_chat_logprobs_bytes_join_characters_split_over_tokens(server: Server):
    """OpenAI's `bytes`: a token that holds part of a character (its text is U+FFFD) has its own bytes, so the
    tokens' bytes joined are the content's UTF-8 (no SmolLM token holds a whole emoji)."""
    body = {"messages": HI, "max_tokens": 12, "temperature": 0, "logprobs": True, "guided_choice": ["😀🎉"]}
    choice = post(server, CHAT, body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["message"]["content"] == "😀🎉" and any("\ufffd" in e["token"] for e in content), content
    assert b"".join(bytes(e["bytes"]) for e in content) == "😀🎉".encode()


def test_return_token_ids_gives_the_ids_behind_the_text(server: Server):
    """vLLM's return_token_ids: each choice's ids (its stop token too), the prompt's once; streamed, every chunk's
    ids and the prompt's in the first chunk; the same ids whole and streamed, and none where it is not asked for."""
    prompt_ids = post(server, "/tokenize", {"prompt": "The capital of France is"}).json()["tokens"]
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "n": 2, "return_token_ids": True}
    r = post(server, CMPL, body).json()
    for choice in r["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids, choice
        text = post(server, "/detokenize", {"tokens": choice["token_ids"]}).json()["prompt"]
        assert text.startswith(choice["text"]) and len(choice["token_ids"]) == r["usage"]["completion_tokens"] // 2
    chunks = stream(server, CMPL, body)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == r["choices"][index]["token_ids"]
    plain = post(server, CMPL, {**body, "return_token_ids": False}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain

    messages = [{"role": "user", "content": "Say hello."}]
    chat = {"messages": messages, "max_tokens": 40, "temperature": 0, "return_token_ids": True}
    r = post(server, CHAT, chat).json()
    assert r["prompt_token_ids"] == post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    ids = r["choices"][0]["token_ids"]
    assert r["choices"][0]["finish_reason"] == "stop" and len(ids) == r["usage"]["completion_tokens"]
    said = post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert said == r["choices"][0]["message"]["content"] + "<|im_end|>", said  # the stop token is among them
    chunks = stream(server, CHAT, chat)
    assert chunks[0]["prompt_token_ids"] == r["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]] == ids
    assert "prompt_token_ids" not in post(server, CHAT, {**chat, "return_token_ids": False}).json()


def test_documents_reach_the_chat_template(hermes_server: Server):
    """vLLM's `documents` go to the template as its `documents` variable (RAG templates show them; the tool servers'
    test template writes them in a system turn), so a request with them is the one with that turn written out."""
    ask = {"role": "user", "content": "What is the capital of France?"}
    docs = [{"title": "Paris", "text": "Paris is the capital of France."}, {"title": "Rome", "text": "Not here."}]
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0}
    with_docs = post(hermes_server, CHAT, {**body, "messages": [ask], "documents": docs}).json()
    turn = {"role": "system", "content": "Documents:\n[Paris] Paris is the capital of France.\n[Rome] Not here.\n"}
    written = post(hermes_server, CHAT, {**body, "messages": [turn, ask]}).json()
    plain = post(hermes_server, CHAT, {**body, "messages": [ask]}).json()
    assert with_docs["usage"]["prompt_tokens"] == written["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    assert with_docs["choices"][0]["message"] == written["choices"][0]["message"]
