"""LoRA adapters over HTTP: listed as models, picked by a request's `model`, named in its answers, equal to
transformers with the adapter merged, and resumed exactly after the engine core is killed mid-stream."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import httpx
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.make_random_lora import ALL, write_adapter
from tests.conftest import REPO, SERVER_ARGS, Server, engine_child, free_port
from tests.engine_helpers import assert_matches_hf, hf_greedy, mixed_prompts, model_dir
from tests.lora_helpers import merged
from tests.test_api_crash import MAX_TOKENS, TOPICS, assert_same, reference_then_start, signal_mid_stream, wait_health

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory):
    """`sql` on all seven linears (given as name=path) and `other` on q and v (given as JSON)."""
    root = tmp_path_factory.mktemp("lora-server")
    config = AutoConfig.from_pretrained(model_dir())
    adapters = {"sql": write_adapter(root / "sql", config, ALL, rank=8, alpha=8, seed=3, std=0.04),
                "other": write_adapter(root / "other", config, ["q_proj", "v_proj"], rank=4, alpha=8, seed=4,
                                       std=0.1)}  # fmt: skip
    server = Server(root, "--enable-lora", "--lora-modules", f"sql={adapters['sql']}",
                    json.dumps({"name": "other", "path": adapters["other"]})).wait_healthy()  # fmt: skip
    yield server, adapters
    server.engine_pid = engine_child(server)  # after the kill test's restart
    server.assert_clean_exit()


def test_models_lists_each_adapter(lora_server):
    server, adapters = lora_server
    listed = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in listed] == [
        (MODEL, MODEL, None), ("sql", adapters["sql"], MODEL), ("other", adapters["other"], MODEL)]  # fmt: skip
    assert httpx.get(server.url + "/v1/models/other", timeout=30).json()["parent"] == MODEL
    unknown = httpx.post(server.url + "/v1/completions", json={"model": "sq", "prompt": "x"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_adapter_completions_match_merged_weights(lora_server):
    """Four prompts in one request under `sql`, and the same under the base model: each as transformers answers."""
    server, adapters = lora_server
    prompts = mixed_prompts()[1::4]
    hf = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32).eval()
    for model, reference in (("sql", merged(hf, adapters["sql"])), (MODEL, hf)):
        body = {"model": model, "prompt": prompts, "max_tokens": 12, "min_tokens": 12, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        ours = [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] for c in choices]
        assert_matches_hf(ours, hf_greedy(prompts, 12, reference), max_flips=1)


def test_streamed_chat_names_its_adapter(lora_server):
    server, _ = lora_server
    body = {"model": "other", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
            "stream": True, "temperature": 0}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert r.status_code == 200 and events
    assert {e["model"] for e in events} == {"other"}
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


def test_adapter_streams_resume_exactly_after_a_kill(lora_server):
    """A restarted engine loads the adapters again, and each resumed stream goes on under its own adapter."""
    server, _ = lora_server
    bodies = [{"model": ("sql", "other", MODEL)[i % 3], "prompt": f"Write a short story about {TOPICS[i]}.",
               "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0 if i % 2 else 0.8, "seed": i}
              for i in range(6)]  # fmt: skip

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            reference, _, runs, tasks = await reference_then_start(client, bodies)
            pid = await signal_mid_stream(server, runs, signal.SIGKILL)
            await wait_health(client, 503, timeout=5)
            await wait_health(client, 200, timeout=120)
            assert engine_child(server) not in (None, pid)
            assert_same(await asyncio.gather(*tasks), reference)

    asyncio.run(scenario())
    assert "resumed 6 unfinished requests" in server.log.read_text()


@pytest.mark.parametrize(("flags", "message"), [
    (["--lora-modules", "sql={sql}"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "sql={sql}", "--max-lora-rank", "4"], "above --max-lora-rank 4"),
    (["--enable-lora", "--lora-modules", "sql={sql}", "--served-model-name", "sql"], "is the base model's name"),
])  # fmt: skip
def test_launch_refuses_bad_lora_flags(lora_server, flags, message):
    """Exit 2 and one line that says why: before the engine starts, or (a name taken by the model) once it has."""
    _, adapters = lora_server
    args = [f.replace("{sql}", adapters["sql"]) for f in flags]
    proc = subprocess.run([sys.executable, "launch.py", "--port", str(free_port()), *SERVER_ARGS, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
