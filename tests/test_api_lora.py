"""LoRA adapters over HTTP: listed as models, picked by a request's `model`, named in its answers, equal to
transformers with the adapter merged, and resumed exactly after the engine core is killed mid-stream."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.make_random_lora import ALL, write_adapter
from frontend.api.lora_adapters import RUNTIME_UPDATES
from tests.conftest import REPO, SERVER_ARGS, Server, engine_child, free_port
from tests.engine_helpers import assert_matches_hf, hf_greedy, mixed_prompts, model_dir
from tests.lora_helpers import merged
from tests.test_api_crash import MAX_TOKENS, TOPICS, assert_same, reference_then_start, signal_mid_stream, wait_health

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory):
    """`sql` on all seven linears (given as name=path) and `other` on q and v (given as JSON); the base model also
    answers to `smol` (a second --served-model-name, given twice: listed once)."""
    root = tmp_path_factory.mktemp("lora-server")
    config = AutoConfig.from_pretrained(model_dir())
    adapters = {"sql": write_adapter(root / "sql", config, ALL, rank=8, alpha=8, seed=3, std=0.04),
                "other": write_adapter(root / "other", config, ["q_proj", "v_proj"], rank=4, alpha=8, seed=4,
                                       std=0.1)}  # fmt: skip
    server = Server(root, "--enable-lora", "--lora-modules", f"sql={adapters['sql']}",
                    json.dumps({"name": "other", "path": adapters["other"]}),
                    "--served-model-name", MODEL, "smol", "smol",
                    env={RUNTIME_UPDATES: "True"}).wait_healthy()  # fmt: skip
    yield server, adapters
    server.engine_pid = engine_child(server)  # after the kill test's restart
    server.assert_clean_exit()


def model_ids(server: Server) -> list[str]:
    return [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]]


def test_models_lists_each_adapter(lora_server):
    """And each served name of the base model, as vLLM lists them; a request may name any, and its answer names the
    first, as vLLM's do; no adapter can take one of them."""
    server, adapters = lora_server
    listed = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in listed] == [
        (MODEL, MODEL, None), ("smol", MODEL, None), ("sql", adapters["sql"], MODEL),
        ("other", adapters["other"], MODEL)]  # fmt: skip
    assert httpx.get(server.url + "/v1/models/other", timeout=30).json()["parent"] == MODEL
    unknown = httpx.post(server.url + "/v1/completions", json={"model": "sq", "prompt": "x"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    by_alias, by_name = (httpx.post(server.url + "/v1/completions", json={**body, "model": m}, timeout=60).json()
                         for m in ("smol", MODEL))  # fmt: skip
    assert by_alias["model"] == MODEL and by_alias["choices"][0]["text"] == by_name["choices"][0]["text"]
    taken = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "smol", "lora_path": adapters["sql"]},
                       timeout=30)  # fmt: skip
    assert taken.status_code == 400 and "conflicts with the served base model" in taken.text


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


def test_metrics_name_the_adapter_of_a_running_stream(lora_server):
    """roseinfer:lora_requests_info, as vLLM's: the adapter of a stream in flight is running; then none is."""
    server, _ = lora_server

    def lora_info() -> str:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        [line] = [line for line in text.splitlines() if line.startswith("roseinfer:lora_requests_info{")]
        return line.split("} ")[0]

    body = {"model": "sql", "prompt": "SELECT", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        during = lora_info()
        assert any(line.startswith("data: {") for line in lines)  # more came after: it was still running
    loaded = sum(m["parent"] is not None for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"])
    labels = f'roseinfer:lora_requests_info{{max_lora="{loaded}",running_lora_adapters='
    assert during == labels + '"sql",waiting_lora_adapters=""'
    assert lora_info() == labels + '"",waiting_lora_adapters=""'


def test_adapter_streams_resume_exactly_after_a_kill(lora_server, tmp_path):
    """A restarted engine loads the adapters again (one loaded at run time when a resumed request names it), and
    each resumed stream goes on under its own adapter. Two adapters unloaded while it restarts (one of
    --lora-modules, one loaded at run time, each with a stream in flight) finish their streams; then their weights
    go: the restarted engine is told of every unload it missed."""
    server, adapters = lora_server
    late = shutil.copytree(adapters["sql"], tmp_path / "late")
    assert load(server, "late", str(late)).status_code == 200
    bodies = [{"model": ("sql", "other", MODEL, "late")[i % 4], "prompt": f"Write a short story about {TOPICS[i]}.",
               "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0 if i % 2 else 0.8, "seed": i}
              for i in range(8)]  # fmt: skip

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            reference, _, runs, tasks = await reference_then_start(client, bodies)
            pid = await signal_mid_stream(server, runs, signal.SIGKILL)
            await wait_health(client, 503, timeout=5)
            for name in ("late", "other"):
                r = await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
                assert r.status_code == 200, r.text
            assert (await client.get("/health")).status_code == 503  # both unloads while no engine was up
            await wait_health(client, 200, timeout=120)
            assert engine_child(server) not in (None, pid)
            assert_same(await asyncio.gather(*tasks), reference)

    asyncio.run(scenario())
    assert "resumed 8 unfinished requests" in server.log.read_text()
    assert loaded_adapters(server) == 1  # sql's: the others' went after their resumed streams
    assert load(server, "other", adapters["other"]).status_code == 200  # for the tests after this one
    assert loaded_adapters(server) == 2


def loaded_adapters(server: Server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    [value] = [line.split()[-1] for line in text.splitlines() if line.startswith("roseinfer:lora_adapters_loaded{")]
    return float(value)


def load(server: Server, name: str, path: str, **kw) -> httpx.Response:
    body = {"lora_name": name, "lora_path": path, **kw}
    return httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=120)


def unload(server: Server, name: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=120)


def greedy(server: Server, model: str, prompts: list[str]) -> list[str] | httpx.Response:
    """Each prompt's greedy continuation under `model`, or the refusal."""
    body = {"model": model, "prompt": prompts, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] if r.status_code == 200 else r


def test_adapters_load_and_unload_at_run_time(lora_server, tmp_path):
    """vLLM's two routes: an adapter loaded while the server runs is listed and answers as the same weights loaded at
    start; `load_inplace` swaps a name's weights; after an unload the name is unknown again."""
    server, adapters = lora_server
    prompts = ["The capital of France is", "def fibonacci(n):"]
    sql, other = greedy(server, "sql", prompts), greedy(server, "other", prompts)
    assert sql != other
    copy = shutil.copytree(adapters["sql"], tmp_path / "copy")
    r = load(server, "late", str(copy))
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'late' added successfully.")
    card = httpx.get(server.url + "/v1/models/late", timeout=30).json()
    assert (card["root"], card["parent"]) == (str(copy), MODEL)
    assert greedy(server, "late", prompts) == sql
    again = load(server, "late", adapters["other"])
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert load(server, "late", adapters["other"], load_inplace=True).status_code == 200
    assert greedy(server, "late", prompts) == other
    r = unload(server, "late")
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'late' removed successfully.")
    gone = greedy(server, "late", prompts)
    assert isinstance(gone, httpx.Response) and gone.status_code == 404
    assert unload(server, "late").status_code == 404
    assert model_ids(server) == [MODEL, "smol", "sql", "other"]
    assert greedy(server, "sql", prompts) == sql


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"lora_name": "x", "lora_path": "{tmp}/missing"}, 404, "no such directory"),
    ({"lora_name": "x", "lora_path": "{tmp}"}, 400, "cannot read adapter_config.json"),
    ({"lora_name": "x", "lora_path": "{big}"}, 400, "above --max-lora-rank 16"),
    ({"lora_name": "x", "lora_path": "{broken}"}, 400, "not a LoRA weight of a linear layer"),
    ({"lora_name": MODEL, "lora_path": "{sql}"}, 400, "conflicts with the served base model"),
    ({"lora_name": "x"}, 400, "lora_path"),
    ({"lora_name": "", "lora_path": "{sql}"}, 400, "Both 'lora_name' and 'lora_path' must be provided"),
])  # fmt: skip
def test_bad_runtime_loads_are_refused_with_the_reason(lora_server, tmp_path, body, status, message):
    """Refused in the API process where the config tells (no engine call), else by the engine, which is unchanged."""
    server, adapters = lora_server
    config = AutoConfig.from_pretrained(model_dir())
    paths = {"tmp": str(tmp_path), "sql": adapters["sql"],
             "big": write_adapter(tmp_path / "big", config, ["q_proj"], rank=32, alpha=32, seed=1),
             "broken": write_adapter(tmp_path / "broken", config, ["q_proj"], rank=4, alpha=4, seed=1)}  # fmt: skip
    (Path(paths["broken"]) / "adapter_model.safetensors").write_bytes(
        (Path(adapters["sql"]) / "adapter_model.safetensors").read_bytes().replace(b"lora_A", b"lora_C"))
    body = {k: v.format(**paths) if isinstance(v, str) else v for k, v in body.items()}
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=120)
    assert r.status_code == status and message in r.json()["error"]["message"], r.text
    assert model_ids(server) == [MODEL, "smol", "sql", "other"]


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
