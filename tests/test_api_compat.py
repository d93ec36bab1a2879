"""OpenAI and vLLM compatibility over HTTP: explicit nulls, fields vLLM honours or refuses, response shapes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import Server

MODEL = "SmolLM2-135M-Instruct"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120)


def stream(server: Server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={"model": MODEL, **body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


SHARED = ["n", "logprobs", "stream", "stream_options", "stop", "temperature", "top_p", "presence_penalty",
          "frequency_penalty", "logit_bias", "seed", "user", "max_tokens", "ignore_eos", "min_tokens", "top_k",
          "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs", "model"]  # fmt: skip
CHAT_NULLABLE = [*SHARED, "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "response_format", "min_p",
                 "add_generation_prompt", "continue_final_message", "repetition_penalty", "stop_token_ids"]  # fmt: skip
CMPL_NULLABLE = [*SHARED, "echo", "suffix", "best_of"]


def test_explicit_nulls_mean_the_default(server: Server):
    """OpenAI types these "X or null" and its client sends null for an option set to None: n, logprobs,
    parallel_tool_calls and echo were 400s."""
    bad = []
    for field in CHAT_NULLABLE:
        body = {"messages": HI, "max_completion_tokens": 1, field: None}
        if (r := post(server, CHAT, body)).status_code != 200:
            bad.append((CHAT, field, r.text))
    for field in CMPL_NULLABLE:
        body = {"prompt": "hi", "max_tokens": 1, field: None}  # max_tokens null: 16
        if (r := post(server, CMPL, body)).status_code != 200:
            bad.append((CMPL, field, r.text))
    message = {"role": "user", "content": "hi", "name": None, "tool_calls": None, "tool_call_id": None}
    if (r := post(server, CHAT, {"messages": [message], "max_tokens": 1})).status_code != 200:
        bad.append((CHAT, "message fields", r.text))
    assert bad == []
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for kw in ({"n": None}, {"logprobs": None}, {"parallel_tool_calls": None}):
        assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, **kw).choices  # type: ignore[call-overload]
    for kw in ({"n": None}, {"echo": None}):
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1, **kw).choices  # type: ignore[call-overload]
    # A required field's null stays an error.
    assert post(server, CMPL, {"prompt": None}).status_code == 400
    assert post(server, CHAT, {"messages": [{"role": None, "content": "hi"}]}).status_code == 400


def test_request_larger_than_the_whole_queue_is_400_not_429(server: Server):
    """17 prompts x n 64 = 1,088 engine requests > --max-queued-requests 1024: never admissible, so no Retry-After."""
    r = post(server, CMPL, {"prompt": ["a"] * 17, "n": 64, "max_tokens": 1})
    assert r.status_code == 400 and "retry-after" not in r.headers, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "n"
    assert "1088" in error["message"] and "1024" in error["message"]


def test_min_tokens_1_does_not_stop_on_a_stop_string_in_the_first_token(server: Server):
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stop": [" "]}
    assert post(server, CMPL, body).json()["choices"][0]["text"] == ""  # the first token is " 4"
    r = post(server, CMPL, {**body, "min_tokens": 1}).json()
    choice = r["choices"][0]
    assert choice["text"] != "" and choice["finish_reason"] == "stop" and choice["stop_reason"] == " ", r
    assert r["usage"]["completion_tokens"] >= 2


def test_completion_top_logprobs_hold_the_sampled_token(server: Server):
    """OpenAI: "the API will always return the logprob of the sampled token, so there may be up to logprobs+1"."""
    body = {"prompt": "Write a story about a dragon", "max_tokens": 12, "temperature": 1.5, "seed": 3}
    for k in (0, 1, 2):
        lp = post(server, CMPL, {**body, "logprobs": k}).json()["choices"][0]["logprobs"]
        for token, own, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
            assert next(iter(top.items())) == (token, own) and 1 <= len(top) <= k + 1, (k, token, top)
    streamed = stream(server, CMPL, {**body, "logprobs": 0})
    tops = [t for c in streamed if c["choices"] and c["choices"][0]["logprobs"]
            for t in c["choices"][0]["logprobs"]["top_logprobs"]]  # fmt: skip
    assert tops and all(len(t) == 1 for t in tops)
    # Echoed prompt positions too: the prompt token's own logprob is always there.
    lp = post(server, CMPL, {**body, "echo": True, "logprobs": 1, "max_tokens": 1}).json()["choices"][0]["logprobs"]
    for token, own, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert top[token] == own and len(top) <= 2


def test_stop_reason_is_null_on_eos_and_the_id_on_a_stop_token(server: Server):
    body = {"messages": [{"role": "user", "content": "Say OK"}], "max_tokens": 100, "temperature": 0}
    choice = post(server, CHAT, body).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None, choice  # EOS: not a stop_token_id
    finish = [c["choices"][0] for c in stream(server, CHAT, body) if c["choices"]][-1]
    assert finish["finish_reason"] == "stop" and finish["stop_reason"] is None
    text = choice["message"]["content"]
    ids = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    stopped = post(server, CHAT, {**body, "stop_token_ids": [ids[-1]]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == ids[-1], stopped


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
    though it came last."""
    body = {"model": MODEL, "messages": HI, "temperature": 0, "ignore_eos": True}

    async def run() -> list[str]:
        done: list[str] = []
        async with httpx.AsyncClient(base_url=priority_server.url, timeout=120) as client:
            async def finish(name: str, **extra) -> None:
                r = await client.post(CHAT, json={**body, "max_tokens": 8, **extra})
                assert r.status_code == 200, r.text
                done.append(name)

            async with client.stream("POST", CHAT, json={**body, "max_tokens": 200, "stream": True}) as first:
                lines = first.aiter_lines()
                while not (await anext(lines)).startswith("data: "):  # running: it holds the one slot
                    pass
                late = asyncio.ensure_future(finish("late", priority=5))
                await asyncio.sleep(0.2)
                urgent = asyncio.ensure_future(finish("urgent", priority=-5))
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


def test_suffix_is_refused_as_vllm_does(server: Server):
    r = post(server, CMPL, {"prompt": "def add(a, b):", "suffix": "\n\nprint(add(1, 2))", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text
    assert "suffix is not currently supported" in r.json()["error"]["message"]


def test_continue_final_message_leaves_the_last_message_open(server: Server):
    start = "Hello, my name is"
    messages = [*HI, {"role": "assistant", "content": start}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    ids = post(server, "/tokenize", {"messages": messages, **flags}).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n" + start), text
    closed = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert closed[: len(ids)] == ids and len(closed) > len(ids)  # the plain form closes the turn
    r = post(server, CHAT, {"messages": messages, **flags, "max_tokens": 3, "temperature": 0}).json()
    assert r["usage"]["prompt_tokens"] == len(ids), r
    for both in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": True}):
        r = post(server, CHAT, {"messages": messages, **both, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_continuous_usage_stats_put_usage_in_every_chunk(server: Server, path: str):
    body = {"max_tokens": 4, "ignore_eos": True, "n": 2, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    body |= {"prompt": "The sea is"} if path == CMPL else {"messages": HI}
    chunks = stream(server, path, body)
    final = chunks[-1]["usage"]
    seen: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        usage, index = chunk["usage"], chunk["choices"][0]["index"]
        assert usage["prompt_tokens"] == final["prompt_tokens"]  # its choice's prompt (one here), as vLLM
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        seen[index].append(usage["completion_tokens"])
    for counts in seen.values():
        assert counts == sorted(counts) and counts[-1] == 4
    assert final["completion_tokens"] == 8
    plain = stream(server, path, {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1])


def test_retrieve_model_gives_the_listed_card_and_404_for_others(server: Server):
    listed = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    r = httpx.get(f"{server.url}/v1/models/{MODEL}", timeout=30)
    assert r.status_code == 200 and [r.json()] == listed, r.text
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "roseinfer")
    for unknown in ("gpt-4o", "org/some-model"):
        r = httpx.get(f"{server.url}/v1/models/{unknown}", timeout=30)
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "model_not_found", error
        assert unknown in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_stream_options_need_stream(server: Server, path: str):
    body = {"prompt": "hi"} if path == CMPL else {"messages": HI}
    body["max_tokens"] = 1
    for stream_flag in ({}, {"stream": False}, {"stream": None}):
        r = post(server, path, {**body, **stream_flag, "stream_options": {"include_usage": True}})
        assert r.status_code == 400, (stream_flag, r.text)
        error = r.json()["error"]
        assert error["param"] == "stream_options" and "only allowed when 'stream' is enabled" in error["message"]
    assert post(server, path, {**body, "stream": False, "stream_options": None}).status_code == 200
    assert stream(server, path, {**body, "stream_options": {"include_usage": True}})[-1]["usage"]


def test_best_of_other_than_n_is_refused(server: Server):
    """best_of was silently ignored; like vLLM's V1 engine we do not rank candidates, so only best_of == n runs."""
    for best_of, n in ((2, 1), (3, 2), (1, 2)):
        r = post(server, CMPL, {"prompt": "hi", "max_tokens": 1, "n": n, "best_of": best_of})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "best_of" and "best_of is not supported" in error["message"], error
    for bad in (0, -1, 2**70, "two", 1.5):  # bounded: never reaches the comparison with n
        r = post(server, CMPL, {"prompt": "hi", "max_tokens": 1, "best_of": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
    for best_of, n in ((None, 2), (1, 1), (2, 2)):
        r = post(server, CMPL, {"prompt": "hi", "max_tokens": 1, "n": n, "best_of": best_of})
        assert r.status_code == 200 and len(r.json()["choices"]) == n, r.text
