"""OpenAI API over HTTP against launch.py: parity with the engine and transformers, parameters, usage, logprobs."""

from __future__ import annotations

import importlib.metadata
import math
from pathlib import Path

import httpx
import openai
import pytest

from common.config import EngineConfig
from common.messages import EngineRequest, SamplingParams
from common.model_source import resolve_model
from frontend.offline.engine_link import EngineClient, token_ids
from tests.conftest import Server

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]
STORY = "Once upon a time, there was a dragon who"


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def direct_engine(server_started: Server):
    """The engine core over ZMQ with no HTTP; loads while the server does, and is gone after its test."""
    with EngineClient(EngineConfig(dtype="float32", num_kv_blocks=512, max_model_len=2048)) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(None).path
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), torch


def greedy(client: openai.OpenAI, prompt, max_tokens: int = 10, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


@pytest.fixture(scope="module")
def base(client: openai.OpenAI):
    """STORY's greedy completion with logprobs: the reference several tests compare against."""
    return greedy(client, STORY, logprobs=3)


def test_greedy_chat_equals_engine_and_transformers(direct_engine, server, client, hf):
    tok, model, torch = hf
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    # Our own (torch-free) chat template rendering produces the same prompt tokens as transformers.
    assert httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()["tokens"] == ids
    ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
    request = EngineRequest("p", ids, SamplingParams(max_tokens=12, temperature=0))
    ours = token_ids(direct_engine.generate([request])["p"])
    assert ours == ref
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref)
    assert r.choices[0].finish_reason == ("stop" if ref[-1] in tok.all_special_ids else "length")


def test_greedy_completion_equals_transformers(base, hf):
    tok, model, torch = hf
    ids = tok(STORY)["input_ids"]
    ref = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids) :].tolist()
    r = base
    assert len(ref) == 10 and r.choices[0].text == tok.decode(ref, skip_special_tokens=True)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref))
    assert r.usage.total_tokens == len(ids) + len(ref)


def test_streaming_equals_non_streaming(client, base):
    full = base
    chunks = list(greedy(client, STORY, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])


def test_chat_streaming_order_and_usage(server):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [httpx.Response(200, content=e).json() for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    plain_body = {**body, "stream": False, "stream_options": None}  # stream_options alone would be a 400
    plain = httpx.post(server.url + "/v1/chat/completions", json=plain_body, timeout=60).json()
    assert text == plain["choices"][0]["message"]["content"] and text


def test_chat_echo_leads_with_the_final_assistant_message(client):
    """vLLM's chat `echo`: with continue_final_message, the open assistant message the model continues is the
    answer's beginning, streamed in the opening chunk; a final user message is not echoed."""
    opened = [*CHAT, {"role": "assistant", "content": "The waves"}]
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    cont = {"messages": opened, "extra_body": {"add_generation_prompt": False, "continue_final_message": True}}
    plain = client.chat.completions.create(**kw, **cont).choices[0].message.content
    echo_body = {**cont["extra_body"], "echo": True}
    echoed = client.chat.completions.create(**kw, messages=opened, extra_body=echo_body)
    assert echoed.choices[0].message.content == "The waves" + plain and plain
    assert echoed.usage.completion_tokens == 6  # the echo is not a completion token
    chunks = list(client.chat.completions.create(**kw, messages=opened, extra_body=echo_body, stream=True))
    assert chunks[0].choices[0].delta.content == "The waves"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == echoed.choices[0].message.content
    unechoed = client.chat.completions.create(**kw, messages=CHAT, extra_body={"echo": True}).choices[0].message
    assert unechoed.content == client.chat.completions.create(**kw, messages=CHAT).choices[0].message.content


def test_n_choices(client):
    kw = {"model": MODEL, "prompt": STORY, "n": 3, "max_tokens": 3, "temperature": 1.0, "seed": 7,
          "extra_body": {"ignore_eos": True}}  # fmt: skip
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 9 and len({c.text for c in r.choices}) > 1
    chunks = list(client.completions.create(**kw, stream=True))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert texts == [c.text for c in sorted(r.choices, key=lambda c: c.index)]  # same seeds, same samples
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1, 2]


def test_stop_string_split_across_tokens(client, base):
    text, tokens = base.choices[0].text, base.choices[0].logprobs.tokens
    assert "".join(tokens) == text
    # A stop string made of the end of one token and the start of the next.
    k = next(i for i in range(2, len(tokens) - 1) if len(tokens[i].strip()) >= 2 and len(tokens[i + 1].strip()) >= 2)
    stop = tokens[k][-2:] + tokens[k + 1][:2]
    at = text.find(stop)
    assert at > 0
    r = greedy(client, STORY, stop=[stop, "never-appears"])
    assert r.choices[0].text == text[:at] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    assert r.usage.completion_tokens == k + 2  # the tokens up to the one that completed the stop string
    streamed = "".join(c.choices[0].text for c in greedy(client, STORY, stop=stop, stream=True))
    assert streamed == text[:at]
    kept = greedy(client, STORY, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: at + len(stop)]


def test_completion_logprobs_and_echo(client, base):
    r = base
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert math.isfinite(chosen) and chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)
    echo = greedy(client, STORY, echo=True, logprobs=1)
    assert echo.choices[0].text == STORY + r.choices[0].text
    elp = echo.choices[0].logprobs
    assert len(elp.tokens) == echo.usage.prompt_tokens + echo.usage.completion_tokens
    assert elp.token_logprobs[0] is None and elp.token_logprobs[-10:] == pytest.approx(lp.token_logprobs)


def test_chat_logprobs(client):
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)
    assert "".join(e.token for e in content) == r.choices[0].message.content
    streamed = [e for c in client.chat.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in content]


def test_token_id_prompts(server, client, base):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": STORY}).json()["tokens"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == STORY
    text = base.choices[0].text
    both = greedy(client, [ids, ids[:5]], max_tokens=3)
    assert [c.index for c in both.choices] == [0, 1] and both.choices[0].text and text.startswith(both.choices[0].text)
    assert both.usage.prompt_tokens == len(ids) + 5
    two = greedy(client, [STORY, "Hello"], max_tokens=1)
    assert [c.index for c in two.choices] == [0, 1] and text.startswith(two.choices[0].text)


def test_seeded_sampling_is_reproducible(client):
    def sample(seed: int) -> str:
        r = client.completions.create(model=MODEL, prompt=STORY, max_tokens=6, temperature=1.0, seed=seed)
        return r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2)}) > 1


@pytest.mark.parametrize("prompt", ["北京是中国的首都。上海是", "I love pizza 🍕🍕! My favorite emojis are"])
def test_multibyte_stream_never_splits_characters(client, prompt):
    full = greedy(client, prompt, logprobs=0).choices[0]
    assert any("\ufffd" in t for t in full.logprobs.tokens)  # some tokens really are partial characters
    chunks = [c.choices[0].text for c in greedy(client, prompt, stream=True)]
    assert all("\ufffd" not in c for c in chunks) and "\ufffd" not in full.text
    assert "".join(chunks) == full.text and any(ord(ch) > 0x2E80 for ch in full.text)


def test_generate_models_metrics_and_request_id(server, client, base):
    body = {"prompt": STORY, "max_tokens": 10, "temperature": 0}
    with httpx.stream("POST", server.url + "/generate", json=body) as r:
        assert r.headers["content-type"].startswith("text/plain")
        text = "".join(r.iter_text())
    assert text == base.choices[0].text
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "abc123"},
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})  # fmt: skip
    assert r.headers["x-request-id"] == "abc123" and "abc123" in r.json()["id"]
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count"):  # fmt: skip
        lines = [x for x in metrics.splitlines() if x.startswith(f"roseinfer:{name}{{")]  # one per engine, or one
        if name.endswith(("_total", "_count")) and "preemptions" not in name:
            assert sum(float(x.split()[-1]) for x in lines) > 0, lines


def test_generated_token_counters_count_every_token(server):
    """Counted once per engine step for the whole batch: the server-wide and per-engine totals move by exactly the
    tokens streamed."""

    def totals() -> tuple[float, float]:
        lines = httpx.get(server.url + "/metrics").text.splitlines()
        return tuple(sum(float(x.split()[-1]) for x in lines if x.startswith(f"roseinfer:{name}_total{{"))
                     for name in ("generation_tokens", "engine_generation_tokens"))  # type: ignore[return-value]

    before = totals()
    body = {"model": MODEL, "prompt": "Count", "max_tokens": 7, "n": 3, "ignore_eos": True, "temperature": 0}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["usage"]["completion_tokens"] == 21
    assert [a - b for a, b in zip(totals(), before, strict=True)] == [21, 21]


def test_api_process_loads_torch_only_for_a_grammar(tmp_path):
    """Plain requests never load torch into the API process. Its own server: the shared one may have checked a
    grammar for an earlier test already (xgrammar, which the API uses to refuse a bad one with a 400, loads torch),
    which made this check depend on the order the tests ran in."""
    server = Server(tmp_path).wait_healthy()
    try:

        def torch_loaded() -> bool:
            maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
            return "libtorch" in maps or "libc10" in maps

        plain = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        chat = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "stream": True}
        assert httpx.post(server.url + "/v1/completions", json=plain, timeout=60).status_code == 200
        assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
        assert not torch_loaded()
        guided = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "guided_choice": ["yes", "no"]}
        assert httpx.post(server.url + "/v1/completions", json=guided, timeout=60).status_code == 200
        assert torch_loaded()  # the check sees it once it is there
    finally:
        server.stop()


def test_ping_answers_as_health_and_version_names_the_package(server) -> None:
    """vLLM's /ping (GET or POST: load balancers and SageMaker probe it) and /version."""
    health = httpx.get(server.url + "/health", timeout=30).json()
    assert health["status"] == "ok"
    assert all(httpx.request(m, server.url + "/ping", timeout=30).json() == health for m in ("GET", "POST"))
    assert httpx.get(server.url + "/version", timeout=30).json() == {"version": importlib.metadata.version("roseinfer")}
