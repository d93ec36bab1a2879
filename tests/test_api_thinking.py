"""Constrained answers of a reasoning model over HTTP (--reasoning-parser deepseek_r1): the grammar waits for the
</think> token, so the thinking is free and comes back as `reasoning`, and the content after it is the grammar's.
The server runs a tiny random model whose tokenizer has <think> and </think> as tokens of their own (two of the
default tokenizer's unused special tokens renamed), as reasoning models' tokenizers have; logit_bias steers it."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from bench.make_random_model import write_model
from frontend.text.tokenizer import Tokenizer
from frontend.tools.reasoning import END, START, thinking_tokens
from tests.conftest import Server

RENAMED = {"<jupyter_start>": START, "<jupyter_text>": END}


def tag_thinking(model: Path) -> None:
    """Renames two unused special tokens to <think> and </think>, plain (not special) tokens as in Qwen3's."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        path = model / name
        if not path.exists():
            continue
        text = path.read_text()
        for old, new in RENAMED.items():
            text = text.replace(json.dumps(old), json.dumps(new))
        data = json.loads(text)
        entries = data.get("added_tokens", []) + list(data.get("added_tokens_decoder", {}).values())
        for entry in entries:
            if entry["content"] in RENAMED.values():
                entry["special"] = False
        extra = data.get("additional_special_tokens")
        if extra is not None:
            data["additional_special_tokens"] = [t for t in extra if t not in RENAMED.values()]
        path.write_text(json.dumps(data))


def tagged_model(path: Path) -> Path:
    """A tiny random model whose tokenizer has <think> and </think> as tokens of their own."""
    write_model("tiny", path)
    tag_thinking(path)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tagged_model(tmp_path_factory.mktemp("thinking") / "model")


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory):
    server = Server(tmp_path_factory.mktemp("thinking_server"), "--model", str(model), "--reasoning-parser",
                    "deepseek_r1").wait_healthy()  # fmt: skip
    yield server
    server.assert_clean_exit()


def test_the_renamed_tags_are_tokens_of_their_own(model: Path) -> None:
    tok = Tokenizer(model)
    start, end = tok.single_token(START), tok.single_token(END)
    assert start is not None and end is not None and tok.decode([start, end]) == START + END
    assert thinking_tokens("qwen3", tok) == (start, end) and thinking_tokens("deepseek_r1", tok) == (None, end)


def test_the_thinking_is_free_and_the_grammar_holds_what_follows(server: Server, model: Path) -> None:
    tok = Tokenizer(model)
    hello, end = tok.single_token("Hello"), tok.single_token(END)
    assert hello is not None and end is not None

    def chat(bias: int, **extra) -> dict:
        body = {"messages": [{"role": "user", "content": "A JSON object, please."}], "max_tokens": 8,
                "temperature": 0, "response_format": {"type": "json_object"}, "logit_bias": {str(bias): 100}, **extra}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    # Pushed to write "Hello": it thinks it all (no </think> came), which a grammar from the first token forbids.
    body = chat(hello)
    thinking = body["choices"][0]
    assert thinking["message"]["reasoning"] == "Hello" * 8 and not thinking["message"]["content"]
    assert thinking["finish_reason"] == "length"
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}
    # Pushed to write </think>: it ends the thinking at once, and the JSON grammar holds every token after it.
    body = chat(end, logprobs=True)
    answer = body["choices"][0]
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    tokens = [entry["token"] for entry in answer["logprobs"]["content"]]
    assert tokens[0] == END and tokens[1:] and not answer["message"].get("reasoning")
    assert answer["message"]["content"] == "".join(tokens[1:]).lstrip() and answer["message"]["content"][0] == "{"


def test_usage_counts_the_thinking_of_every_choice_in_a_stream(server: Server, model: Path) -> None:
    """The final usage chunk's reasoning_tokens, as vLLM reports it: each choice's tokens before its </think>."""
    tok = Tokenizer(model)
    hello = tok.single_token("Hello")
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0, "n": 2,
            "logit_bias": {str(hello): 100}, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 10 and usage["completion_tokens_details"] == {"reasoning_tokens": 10}
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning") or "" for c in chunks[:-1])
    assert reasoning == "Hello" * 10


def test_responses_report_the_thinking_in_output_tokens_details(server: Server) -> None:
    """/v1/responses takes the same count: under deepseek_r1 an answer without </think> thinks throughout, so the
    random model's greedy answer is all reasoning."""
    body = {"input": "Hi", "max_output_tokens": 6, "temperature": 0}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [item["type"] for item in out["output"]][:1] == ["reasoning"]
    usage = out["usage"]
    assert usage["output_tokens"] == 6 and usage["output_tokens_details"]["reasoning_tokens"] == 6


def test_messages_return_the_thinking_as_a_thinking_block(server: Server) -> None:
    """/v1/messages (Anthropic's) returns the reasoning as a thinking block, whole and streamed; a thinking block
    sent back is left out of the prompt."""
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    ask = [{"role": "user", "content": "Hi"}]
    body = {"model": model, "max_tokens": 6, "temperature": 0, "messages": ask}
    reasoning = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 6},
                           timeout=120).json()["choices"][0]["message"]["reasoning"]  # fmt: skip
    whole = httpx.post(server.url + "/v1/messages", json=body, timeout=120).json()
    assert whole["content"] == [{"type": "thinking", "thinking": reasoning, "signature": ""}]
    assert whole["stop_reason"] == "max_tokens" and whole["usage"]["output_tokens"] == 6
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    [start] = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    pieces = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert start["type"] == "thinking" and {p["type"] for p in pieces} == {"thinking_delta"}
    assert "".join(p["thinking"] for p in pieces) == reasoning
    turn = [*ask, {"role": "assistant", "content": [{"type": "thinking", "thinking": reasoning, "signature": ""},
                                                    {"type": "text", "text": "Hello."}]},
            {"role": "user", "content": "Again."}]  # fmt: skip
    without = [*ask, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again."}]
    counts = [httpx.post(server.url + "/v1/messages/count_tokens", json={"model": model, "messages": m}).json()
              for m in (turn, without)]  # fmt: skip
    assert counts[0] == counts[1] and counts[0]["input_tokens"] > 10
