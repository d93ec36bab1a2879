"""--generation-config and --override-generation-config (vLLM's): the model creator's sampling defaults fill what a
request leaves out, max_new_tokens caps every request, and a bad one stops the server at start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from frontend.api.protocol import ChatCompletionRequest
from frontend.api.sampling_defaults import GenerationConfigError, SamplingDefaults, load_sampling_defaults
from frontend.api.serving import ServingContext
from tests.conftest import REPO, Server
from tests.test_api_compat import CHAT, post

QWEN_LIKE = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 3], "temperature": 0.7, "top_p": 0.8,
             "top_k": 20, "repetition_penalty": 1.05, "transformers_version": "4.45.0"}  # fmt: skip


def folder(path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_the_models_sampling_keys_become_defaults_and_the_rest_is_ignored(tmp_path: Path):
    d = load_sampling_defaults(folder(tmp_path, QWEN_LIKE), "auto", None)
    assert d == SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    assert d.overridden() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert load_sampling_defaults(tmp_path, "vllm", None) == SamplingDefaults()
    assert load_sampling_defaults(tmp_path / "absent", "auto", None) == SamplingDefaults()  # a model without one
    over = load_sampling_defaults(tmp_path, "auto", '{"temperature": 0, "max_new_tokens": 7, "top_p": null}')
    assert (over.temperature, over.top_p, over.top_k, over.max_tokens) == (0.0, 0.8, 20, 7)
    elsewhere = folder(tmp_path / "other", {"min_p": 0.1})
    assert load_sampling_defaults(tmp_path, str(elsewhere), None) == SamplingDefaults(min_p=0.1)


@pytest.mark.parametrize("config, override, says", [
    ({"top_p": 0}, None, "top_p is 0"),
    ({"temperature": "hot"}, None, "temperature is 'hot'"),
    ({"top_k": 2.5}, None, "top_k is 2.5"),
    ({"max_new_tokens": 0}, None, "max_tokens is 0"),
    ({}, '{"temprature": 0.5}', "unknown keys ['temprature']"),
    ({}, "[1]", "must be a JSON object"),
    ({}, "{", "is not JSON"),
])  # fmt: skip
def test_a_bad_generation_config_names_its_problem(tmp_path: Path, config: dict, override: str | None, says: str):
    with pytest.raises(GenerationConfigError) as err:
        load_sampling_defaults(folder(tmp_path, config), "auto", override)
    assert says in str(err.value)
    with pytest.raises(GenerationConfigError, match="no generation_config.json"):
        load_sampling_defaults(tmp_path, str(tmp_path / "nowhere"), None)


def test_a_requests_own_values_win_and_max_new_tokens_caps_every_request():
    d = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05, max_tokens=64)
    left_out = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).sampling_params(16, None, d)
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.min_p, left_out.repetition_penalty) == (
        0.7, 0.8, 20, 0.05, 1.05)  # fmt: skip
    given = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0, top_p=1, top_k=-1,
                                  min_p=0, repetition_penalty=1).sampling_params(16, None, d)  # fmt: skip
    assert (given.temperature, given.top_p, given.top_k, given.min_p, given.repetition_penalty) == (0, 1, 0, 0, 1)
    ctx = ServingContext(None, None, "m", max_model_len=2048, vocab_size=100, sampling_defaults=d)  # type: ignore[arg-type]
    assert ctx.max_tokens(100, None, "max_tokens") == 64
    assert ctx.max_tokens(100, 500, "max_tokens") == 64  # as vLLM: a server-wide limit
    assert ctx.max_tokens(100, 10, "max_tokens") == 10
    assert ServingContext(None, None, "m", 2048, 100).max_tokens(100, None, "max_tokens") == 1948  # type: ignore[arg-type]


def test_a_server_samples_with_the_configs_defaults(tmp_path: Path):
    """top_k 1 from the config makes a request that names no top_k greedy (n=4 identical choices); one that turns
    top_k off samples (they differ); max_new_tokens caps the length; Responses echo the default temperature."""
    config = folder(tmp_path / "gen", {"temperature": 0.5, "top_k": 1, "max_new_tokens": 6})
    server = Server(tmp_path, "--generation-config", str(config)).wait_healthy()
    try:
        msgs = [{"role": "user", "content": "Tell me a long story about a dragon."}]
        r = post(server, CHAT, {"messages": msgs, "n": 4, "ignore_eos": True, "max_tokens": 40, "seed": 3}).json()
        texts = {c["message"]["content"] for c in r["choices"]}
        assert len(texts) == 1 and r["usage"]["completion_tokens"] == 24, r
        assert {c["finish_reason"] for c in r["choices"]} == {"length"}
        r = post(server, CHAT, {"messages": msgs, "n": 4, "ignore_eos": True, "seed": 3, "top_k": 0,
                                "temperature": 1.5}).json()  # fmt: skip
        assert len({c["message"]["content"] for c in r["choices"]}) > 1, r
        resp = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2}).json()
        assert resp["temperature"] == 0.5 and resp["top_p"] == 1.0, resp
        assert "sampling defaults from the generation config" in server.log_text()
    finally:
        server.assert_clean_exit()


def test_a_bad_override_stops_the_server_before_the_engine_loads():
    for flags, says in ((["--override-generation-config", '{"temprature": 0.5}'], "unknown keys"),
                        (["--generation-config", "/nonexistent"], "no generation_config.json")):  # fmt: skip
        done = subprocess.run([sys.executable, "launch.py", "--port", "0", *flags], cwd=REPO, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2 and says in done.stderr, done.stderr
