"""POST /v1/embeddings on a pooling server (--runner pooling), through OpenAI's client: a sentence-transformers
directory of a random Qwen3 decoder without an LM head (last-token pooling, normalized, Matryoshka lengths), the
default tokenizer. Each embedding equals transformers' base model's normalized last hidden state."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers

from bench.make_random_model import TOKENIZER_FILES, write_sentence_transformers
from common.model_source import resolve_model
from frontend.offline.llm import LLM
from tests.conftest import REPO, Server, engine_child, free_port
from tests.engine_helpers import GPU_TEST_KV
from tests.gguf_helpers import random_model
from tests.test_api_streaming import assert_engine_idle_within, metric

NAME = "tiny-embed"
HIDDEN = 64
TEXTS = ["The lighthouse keeper trimmed the wick.", "Bread rises because yeast makes gas.", "x"]


def write_embedding_model(path) -> transformers.Qwen3Model:
    tokenizer_dir = resolve_model(None).path
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256)  # fmt: skip
    model = random_model(transformers.Qwen3Model, config)
    model.save_pretrained(path)
    config_path = path / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "matryoshka_dimensions": [16, 32]}))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    write_sentence_transformers(path, HIDDEN)
    return model


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.Qwen3Model]:
    path = tmp_path_factory.mktemp("embedding-model")
    return path, write_embedding_model(path)


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory: pytest.TempPathFactory,
                 embedding_model) -> Iterator[tuple[Server, transformers.Qwen3Model]]:  # fmt: skip
    path, model = embedding_model
    # No --runner: a sentence-transformers directory starts as a pooling server by itself. Steps of 64 tokens: a
    # long input is chunked, and a request of many inputs takes a few seconds (long enough to crash mid-way).
    server = Server(tmp_path_factory.mktemp("embed"), "--model", str(path), "--served-model-name", NAME,
                    "--max-model-len", "64", "--max-num-batched-tokens", "64")  # fmt: skip
    yield server.wait_healthy(), model
    server.engine_pid = engine_child(server)  # a restarted one, after the crash test
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
    ({"input": ["x"] * 1025}, "input", "1025 engine requests (one per input), more than the server ever queues"),
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


def test_an_embedding_model_scores_and_reranks_by_cosine(embed_server) -> None:
    server, model = embed_server
    query, documents = TEXTS[0], TEXTS[1:]
    unit = {t: expected(model, token_ids(server, t)) for t in TEXTS}
    cosines = [float(unit[query] @ unit[d]) for d in documents]
    body = httpx.post(server.url + "/score", json={"text_1": query, "text_2": documents}).json()
    assert [d["index"] for d in body["data"]] == [0, 1]
    np.testing.assert_allclose([d["score"] for d in body["data"]], cosines, atol=1e-5)
    body = httpx.post(server.url + "/v1/rerank", json={"query": query, "documents": documents, "top_n": 1}).json()
    best = int(np.argmax(cosines))
    assert [(r["index"], r["document"]["text"]) for r in body["results"]] == [(best, documents[best])]
    np.testing.assert_allclose(body["results"][0]["relevance_score"], cosines[best], atol=1e-5)
    r = httpx.post(server.url + "/classify", json={"input": "x"})
    assert r.status_code == 400 and "serves an embedding model" in r.json()["error"]["message"]


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


def test_the_offline_llm_embeds_as_the_server_does(embed_server, embedding_model) -> None:
    server, model = embed_server
    path, _ = embedding_model
    ids = token_ids(server, TEXTS[1])
    with LLM(str(path), dtype="float32", **GPU_TEST_KV) as llm:
        vectors = llm.embed([TEXTS[1], ids[:3]], use_tqdm=False)
        scores = llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
    np.testing.assert_allclose(vectors[0], expected(model, ids), atol=1e-5)
    np.testing.assert_allclose(vectors[1], expected(model, ids[:3]), atol=1e-5)
    unit = {t: expected(model, token_ids(server, t)) for t in TEXTS}
    np.testing.assert_allclose(scores, [float(unit[TEXTS[0]] @ unit[d]) for d in TEXTS[1:]], atol=1e-5)


def test_a_pooling_the_server_cannot_compute_stops_it_at_start(tmp_path, embedding_model) -> None:
    path, _ = embedding_model
    shutil.copytree(path, tmp_path / "mean")
    pooling = tmp_path / "mean" / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "pooling_mode_lasttoken": False,
                                   "pooling_mode_mean_tokens": True}))  # fmt: skip
    r = subprocess.run([sys.executable, "launch.py", "--model", str(tmp_path / "mean"), "--port", str(free_port())],
                       cwd=REPO, env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 1
    assert "pooling mean_tokens is not supported" in r.stderr.splitlines()[-1] and "Traceback" not in r.stderr


def test_an_embedding_request_survives_an_engine_crash(embed_server) -> None:
    """kill -9 of the engine core while a request of 1000 inputs runs: the restarted engine embeds what was left,
    and the answer is whole and right. (Last in this file: its server's engine is a new one afterwards.)"""
    server, model = embed_server
    rng = np.random.default_rng(7)
    inputs = [rng.integers(10, 40000, 60).tolist() for _ in range(1000)]
    restarts = metric(server, "engine_restarts_total")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, server.url + "/v1/embeddings", json={"input": inputs}, timeout=300)
        deadline = time.monotonic() + 60
        while metric(server, "num_requests_running") == 0:
            assert time.monotonic() < deadline and not answer.done(), "the request never ran"
            time.sleep(0.01)
        pid = engine_child(server)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert not answer.done(), "the request ended before the crash"
        r = answer.result()
    assert r.status_code == 200, r.text
    assert metric(server, "engine_restarts_total") == restarts + 1 and engine_child(server) != pid
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(1000))
    for i in range(0, 1000, 50):
        np.testing.assert_allclose(data[i]["embedding"], expected(model, inputs[i]), atol=1e-5)
    assert "resumed" in server.log_text()
