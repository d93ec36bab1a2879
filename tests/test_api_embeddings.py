"""POST /v1/embeddings on a pooling server (--runner pooling), through OpenAI's client: a sentence-transformers
directory of a random Qwen3 decoder without an LM head (last-token pooling, normalized, Matryoshka lengths), the
default tokenizer. Each embedding equals transformers' base model's normalized last hidden state."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers

from bench.make_random_model import TOKENIZER_FILES
from common.model_source import resolve_model
from tests.conftest import Server
from tests.test_api_streaming import assert_engine_idle_within

NAME = "tiny-embed"
HIDDEN = 64
TEXTS = ["The lighthouse keeper trimmed the wick.", "Bread rises because yeast makes gas.", "x"]


def write_embedding_model(path) -> transformers.Qwen3Model:
    torch.manual_seed(0)
    tokenizer_dir = resolve_model(None).path
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256)  # fmt: skip
    model = transformers.Qwen3Model(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param))
    model.save_pretrained(path)
    config_path = path / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "matryoshka_dimensions": [16, 32]}))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    st = "sentence_transformers.models."
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"},
    ]))  # fmt: skip
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True}))  # fmt: skip
    return model


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, transformers.Qwen3Model]]:
    tmp = tmp_path_factory.mktemp("embed")
    model = write_embedding_model(tmp / "model")
    # No --runner: a sentence-transformers directory starts as a pooling server by itself.
    server = Server(tmp, "--model", str(tmp / "model"), "--served-model-name", NAME, "--max-model-len", "64")
    yield server.wait_healthy(), model
    server.assert_clean_exit()


def expected(model: transformers.Qwen3Model, ids: list[int], length: int = HIDDEN) -> np.ndarray:
    with torch.inference_mode():
        vector = model(torch.tensor([ids])).last_hidden_state[0, -1, :length].numpy()
    return vector / np.linalg.norm(vector)


def token_ids(server: Server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]


def test_openai_client_gets_the_models_normalized_last_hidden_states(embed_server) -> None:
    server, model = embed_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    answer = client.embeddings.create(model=NAME, input=TEXTS)  # the client asks for base64 and decodes it
    assert answer.model == NAME and [d.index for d in answer.data] == [0, 1, 2]
    ids = [token_ids(server, t) for t in TEXTS]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    for data, prompt in zip(answer.data, ids, strict=True):
        assert len(data.embedding) == HIDDEN
        np.testing.assert_allclose(data.embedding, expected(model, prompt), atol=1e-5)
    # The same as floats in JSON, and from token ids.
    body = httpx.post(server.url + "/v1/embeddings", json={"input": ids, "encoding_format": "float"}).json()
    for data, prompt in zip(body["data"], ids, strict=True):
        np.testing.assert_allclose(data["embedding"], expected(model, prompt), atol=1e-5)
    one = httpx.post(server.url + "/v1/embeddings", json={"input": ids[0], "encoding_format": "base64"}).json()
    (data,) = one["data"]
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(data["embedding"]), "<f4"), expected(model, ids[0]),
                               atol=1e-5)  # fmt: skip
    assert_engine_idle_within(server, 5)


def test_matryoshka_dimensions_cut_then_normalize(embed_server) -> None:
    server, model = embed_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    prompt = token_ids(server, TEXTS[0])
    for length in (16, 32, HIDDEN):
        (data,) = client.embeddings.create(model=NAME, input=TEXTS[0], dimensions=length).data
        np.testing.assert_allclose(data.embedding, expected(model, prompt, length), atol=1e-5)
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "dimensions": 20})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    assert "[16, 32]" in r.json()["error"]["message"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": [[]]}, "input", "empty"),
    ({"input": [10**9]}, "input", "outside the vocabulary"),
    ({"input": [1] * 65}, "input", "maximum context length is 64"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": "x", "priority": 1}, "priority", "not enabled"),
])  # fmt: skip
def test_bad_embedding_requests_are_400s(embed_server, body: dict, param: str, words: str) -> None:
    server, _ = embed_server
    r = httpx.post(server.url + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"


def test_a_whole_context_embeds_and_truncation_keeps_the_last_tokens(embed_server) -> None:
    server, model = embed_server
    prompt = list(range(1, 101))
    body = httpx.post(server.url + "/v1/embeddings", json={"input": prompt, "truncate_prompt_tokens": 64,
                                                           "encoding_format": "float"}).json()  # fmt: skip
    np.testing.assert_allclose(body["data"][0]["embedding"], expected(model, prompt[-64:]), atol=1e-5)
    assert body["usage"]["prompt_tokens"] == 64


def test_a_pooling_server_does_not_generate(embed_server) -> None:
    server, _ = embed_server
    for path, body in [("/v1/completions", {"prompt": "hi"}), ("/generate", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/responses", {"input": "hi"})]:  # fmt: skip
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert "serves embeddings (--runner pooling)" in r.json()["error"]["message"]
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [NAME]
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "model": "other"})
    assert r.status_code == 404


def test_a_generating_server_refuses_embeddings(server: Server) -> None:
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400
    assert "--runner pooling" in r.json()["error"]["message"]
