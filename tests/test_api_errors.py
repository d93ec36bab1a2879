"""Bad input: an OpenAI-shaped 400 (404 for an unknown model) naming the field, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Server

MODEL = "SmolLM2-135M-Instruct"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]

CASES = [
    # (endpoint, body (dict, or raw bytes), status, param, words in the message)
    (CMPL, b'{"prompt": "x", ', 400, None, "JSON"),
    (CMPL, b"[1, 2]", 400, None, "dictionary"),
    (CMPL, {"max_tokens": 2}, 400, "prompt", "required"),
    (CMPL, {"prompt": 5}, 400, "prompt", "prompt"),
    (CMPL, {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "integer"),
    (CMPL, {"prompt": "x", "model": "gpt-4"}, 404, "model", "gpt-4"),
    (CMPL, {"prompt": ""}, 400, "prompt", "empty"),
    (CMPL, {"prompt": []}, 400, "prompt", "empty"),
    (CMPL, {"prompt": [[]]}, 400, "prompt", "empty"),
    (CMPL, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", "greater than or equal to 0"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    (CMPL, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", "prompt logprobs of 21, which is greater "
     "than max allowed: 20"),  # vLLM's words
    (CMPL, {"prompt": "x", "max_tokens": 2048}, 400, "max_tokens", "maximum context length is 2048"),
    (CMPL, {"prompt": [1, 2, 49152]}, 400, "prompt", "vocabulary"),
    (CMPL, {"prompt": [1, -1]}, 400, "prompt", "vocabulary"),
    (CMPL, {"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids", "vocabulary"),
    (CMPL, {"prompt": "x", "temperature": -0.5}, 400, "temperature", "greater than or equal to 0"),
    (CMPL, {"prompt": "x", "top_p": 0}, 400, "top_p", "greater than 0"),
    (CMPL, {"prompt": "x", "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    (CMPL, {"prompt": "x", "n": 0}, 400, "n", "greater than or equal to 1"),
    (CMPL, {"prompt": "x", "n": 10_000}, 400, "n", "less than or equal to"),
    (CMPL, {"prompt": "x", "stop": [f"s{i}" for i in range(40)]}, 400, "stop", "at most"),
    (CMPL, {"prompt": "x", "logprobs": 50}, 400, "logprobs", "sample logprobs of 50, which is greater than max"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "max allowed: 20"),
    (CMPL, {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens", "max_tokens"),
    (CMPL, {"prompt": "x", "seed": 2**70}, 400, "seed", "less than or equal to"),
    (CHAT, {"messages": []}, 400, "messages", "at least 1"),
    (CHAT, {"messages": "hi"}, 400, "messages", "list"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "role"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages", "required"),
    (CHAT, {"messages": IMAGE}, 400, "messages", "text"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 5000}, 400, "max_completion_tokens", "context length"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    (CHAT, {"messages": MSG, "model": "nope"}, 404, "model", "nope"),
    ("/generate", {"prompt": "x", "n": 2}, 400, "n", "one completion"),
    ("/detokenize", {"tokens": [99999999]}, 400, "tokens", "vocabulary"),
    ("/tokenize", {}, 400, "prompt", "exactly one"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), CASES, ids=[str(c[1])[:40] for c in CASES])
def test_bad_input_is_an_openai_error(server: Server, path, body, status, param, words):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {
        "json": {"model": MODEL, **body}}  # fmt: skip
    r = httpx.post(server.url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words.lower() in error["message"].lower(), error["message"]
    # The server (and its engine) still serve a normal request.
    ok = httpx.post(server.url + CMPL, json={"model": MODEL, "prompt": "Hello", "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1


def test_unknown_route_and_method_are_openai_errors(server: Server):
    for r in (httpx.get(server.url + "/v1/nothing"), httpx.delete(server.url + "/v1/models")):
        assert r.status_code in (404, 405) and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/health").status_code == 200
