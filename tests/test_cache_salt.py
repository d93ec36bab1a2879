"""vLLM's cache_salt: a request's prefix-cache blocks are shared only with requests of the same salt, so a tenant with
its own secret salt cannot be probed through cache hits; the answers themselves do not change."""

from __future__ import annotations

import uuid

import httpx
import msgspec

from common.messages import EngineRequest, FinishReason
from engine_core.core import EngineCore
from tests.conftest import Server
from tests.engine_helpers import CORPUS, fp32_config, greedy_request, run_engine, save_tiny_llama

PROMPT = list(range(20, 90))  # 70 tokens: four full blocks of 16


def test_blocks_are_shared_only_under_the_same_salt(tmp_path):
    core = EngineCore(fp32_config(model=save_tiny_llama(tmp_path, max_positions=256, init=0.2)))

    def served(rid: str, salt: str) -> tuple[int, list[int]]:
        request = msgspec.structs.replace(greedy_request(rid, PROMPT, 8), cache_salt=salt)
        outputs = run_engine(core, [request])[rid]
        return outputs[0].num_cached_tokens, [t for o in outputs for t in o.new_token_ids]

    first_cached, tokens = served("a1", "tenant-a")
    assert first_cached == 0
    assert served("b1", "tenant-b") == (0, tokens)  # another salt: nothing shared, the same answer
    assert served("none", "") == (0, tokens)
    assert served("a2", "tenant-a") == (64, tokens)
    assert served("none-2", "") == (64, tokens)


def test_engine_refuses_an_oversized_salt(tmp_path):
    core = EngineCore(fp32_config(model=save_tiny_llama(tmp_path, max_positions=256, init=0.2)))
    request = EngineRequest("big", PROMPT, greedy_request("x", PROMPT, 2).params, cache_salt="s" * 5000)
    (out,) = run_engine(core, [request])["big"]
    assert out.finish_reason == FinishReason.ERROR and out.error == "cache_salt too long"


def test_api_takes_cache_salt_and_refuses_an_empty_one(server: Server):
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 2, "cache_salt": ""}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    r = httpx.post(server.url + "/v1/completions", json={**body, "cache_salt": "s" * 257}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text

    def cached(salt: str) -> int:
        body = {"input": CORPUS[:600], "max_output_tokens": 2, "cache_salt": salt}
        r = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens_details"]["cached_tokens"]

    salt = uuid.uuid4().hex
    assert cached(salt) == 0
    assert cached(salt) > 64
    assert cached(uuid.uuid4().hex) == 0
