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


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_model("tiny", tmp_path_factory.mktemp("thinking") / "model")
    tag_thinking(path)
    return path


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
        return r.json()["choices"][0]

    # Pushed to write "Hello": it thinks it all (no </think> came), which a grammar from the first token forbids.
    thinking = chat(hello)
    assert thinking["message"]["reasoning"] == "Hello" * 8 and not thinking["message"]["content"]
    assert thinking["finish_reason"] == "length"
    # Pushed to write </think>: it ends the thinking at once, and the JSON grammar holds every token after it.
    answer = chat(end, logprobs=True)
    tokens = [entry["token"] for entry in answer["logprobs"]["content"]]
    assert tokens[0] == END and tokens[1:] and not answer["message"].get("reasoning")
    assert answer["message"]["content"] == "".join(tokens[1:]).lstrip() and answer["message"]["content"][0] == "{"
