"""OpenAI and vLLM compatibility over HTTP: explicit nulls, fields vLLM honours or refuses, response shapes."""

from __future__ import annotations

import json

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


def test_tokenize_returns_the_vocabulary_pieces_when_asked(server: Server):
    plain = post(server, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert "token_strs" not in plain
    asked = post(server, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False,
                                       "return_token_strs": True}).json()  # fmt: skip
    assert asked["tokens"] == plain["tokens"] and asked["token_strs"] == ["Hello", "Ġworld"], asked


def test_suffix_is_refused_as_vllm_does(server: Server):
    r = post(server, CMPL, {"prompt": "def add(a, b):", "suffix": "\n\nprint(add(1, 2))", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text
    assert "suffix is not currently supported" in r.json()["error"]["message"]


def test_a_request_chat_template_is_refused_not_ignored(server: Server):
    for path, body in ((CHAT, {"messages": HI, "max_tokens": 2}), ("/tokenize", {"messages": HI})):
        r = post(server, path, {**body, "chat_template": "{{ messages[0].content }}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        assert "--chat-template" in r.json()["error"]["message"]
        assert post(server, path, {**body, "chat_template": None}).status_code == 200  # null: unset


def test_beam_search_is_refused_not_answered_with_samples(server: Server):
    for path, body in ((CHAT, {"messages": HI}), (CMPL, {"prompt": "The sky is"})):
        r = post(server, path, {**body, "use_beam_search": True, "n": 2, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search", r.text
        assert post(server, path, {**body, "use_beam_search": False, "max_tokens": 2}).status_code == 200


def test_vllm_extras_that_would_change_the_answer_are_refused(server: Server):
    for path, body, param in ((CMPL, {"prompt_embeds": "AAAA"}, "prompt_embeds"),
                              (CMPL, {"prompt": "hi", "prompt_embeds": "AAAA"}, "prompt_embeds"),
                              (CHAT, {"messages": HI, "logits_processors": ["m.Proc"]}, "logits_processors")):
        r = post(server, path, {**body, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


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
