"""Prompt logprobs: the engine's against transformers' log_softmax (fp32, a tiny random Llama), across chunked
prefill, prefix-cache hits, preemption, max_tokens 0 and crash resume; then the API shapes over HTTP (echo +
logprobs as lm-evaluation-harness reads them, vLLM's prompt_logprobs on completions and chat, bad values)."""

from __future__ import annotations

import httpx
import pytest
import torch

from common.messages import EngineOutput, EngineRequest, FinishReason, Logprobs, SamplingParams
from engine_core import model_runner
from engine_core.core import EngineCore
from tests.conftest import Server
from tests.engine_helpers import fp32_config, run_engine
from tests.test_model_parity import random_prompts, tiny_hf_model

TOL = 1e-3
VOCAB = 128
K = 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = tiny_hf_model("llama3-rope")
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)
    return hf, str(path)


def scoring(rid: str, prompt: list[int], k: int | None = K, max_tokens: int = 1, **kw) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=k), **kw)


@torch.inference_mode()
def assert_matches_hf(hf, prompt: list[int], lp: Logprobs | None, k: int = K) -> None:
    assert lp is not None
    logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)[:-1]
    own = logp.gather(1, torch.tensor(prompt[1:])[:, None])
    assert len(lp.token_logprobs) == len(prompt) - 1
    if len(prompt) == 1:  # the first token has no logprob
        assert lp.top_ids == lp.ranks == []
        return
    assert (torch.tensor(lp.token_logprobs) - own[:, 0]).abs().max() < TOL
    assert lp.ranks == ((logp > own).sum(dim=-1) + 1).tolist()
    vals, ids = logp.topk(k, dim=-1)
    assert lp.top_ids == ids.tolist()
    assert (torch.tensor(lp.top_logprobs) - vals).abs().max() < TOL


def first_outputs(results: dict[str, list[EngineOutput]]) -> dict[str, EngineOutput]:
    # Sent once: with the first output, never after.
    assert all(o.prompt_logprobs is None for outs in results.values() for o in outs[1:])
    return {rid: outs[0] for rid, outs in results.items()}


def test_batch_matches_hf(tiny) -> None:
    hf, path = tiny
    core = EngineCore(fp32_config(model=path))
    prompts = random_prompts([1, 2, 9, 33, 70], VOCAB, seed=4)
    reqs = [scoring(f"p{i}", p, max_tokens=3) for i, p in enumerate(prompts)]
    reqs.append(scoring("own-only", prompts[3], k=0))
    reqs.append(EngineRequest("plain", prompts[4], SamplingParams(max_tokens=3, temperature=0.0)))
    first = first_outputs(run_engine(core, reqs))
    for i, p in enumerate(prompts):
        assert_matches_hf(hf, p, first[f"p{i}"].prompt_logprobs)
    own = first["own-only"].prompt_logprobs
    assert own is not None and own.top_ids == [[]] * 32
    assert own.token_logprobs == first["p3"].prompt_logprobs.token_logprobs
    assert first["plain"].prompt_logprobs is None


def test_chunk_boundaries_inside_the_prompt(tiny) -> None:
    """An 8-token budget splits every prompt into chunks, beside another request's chunks and decodes."""
    hf, path = tiny
    core = EngineCore(fp32_config(model=path, max_num_batched_tokens=8))
    prompts = random_prompts([29, 17, 8], VOCAB, seed=5)
    reqs = [scoring(f"c{i}", p, max_tokens=2) for i, p in enumerate(prompts)]
    first = first_outputs(run_engine(core, reqs, stagger=1))
    for i, p in enumerate(prompts):
        assert_matches_hf(hf, p, first[f"c{i}"].prompt_logprobs)


def test_prefix_cache_hit_is_recomputed_then_shared(tiny) -> None:
    """A cached prefix would skip the forward that gives its positions' logits, so a request that asks takes no
    hit (reports 0 cached tokens), is still exact, and registers its blocks for the plain requests after it."""
    hf, path = tiny
    core = EngineCore(fp32_config(model=path, block_size=16))
    prefix = random_prompts([64], VOCAB, seed=6)[0]
    a, b = prefix + [3, 4, 5], prefix + [7, 8]
    run_engine(core, [EngineRequest("warm", a, SamplingParams(max_tokens=1, temperature=0.0))])
    first = first_outputs(run_engine(core, [scoring("scored", b)]))
    assert first["scored"].num_cached_tokens == 0
    assert_matches_hf(hf, b, first["scored"].prompt_logprobs)
    after = run_engine(core, [EngineRequest("plain", b + [9], SamplingParams(max_tokens=1, temperature=0.0))])
    assert after["plain"][0].num_cached_tokens == 64
    assert core.scheduler.prefix_hits >= 64


def test_preempted_mid_prompt_resumes_from_what_it_scored(tiny) -> None:
    """Preempted after two 16-token chunks: it re-admits with the two blocks it scored as cache hits, scores
    only the rest, and the whole list still matches transformers."""
    hf, path = tiny
    core = EngineCore(fp32_config(model=path, block_size=16, max_num_batched_tokens=16))
    prompt = random_prompts([57], VOCAB, seed=7)[0]
    core.add_request(scoring("pre", prompt))
    assert core.step() == [] and core.step() == []
    req = core.scheduler.requests["pre"]
    assert req.prompt_logprobs is not None and req.prompt_logprobs.num_done == 32
    core.scheduler._preempt(req)
    outs: list[EngineOutput] = []
    while core.has_work:
        outs += core.step()
    assert outs[0].num_cached_tokens == 32
    assert_matches_hf(hf, prompt, outs[0].prompt_logprobs)
    assert core.kv.num_used_blocks == 0


def test_max_tokens_zero_scores_without_generating(tiny) -> None:
    hf, path = tiny
    core = EngineCore(fp32_config(model=path, max_num_batched_tokens=16))
    prompts = random_prompts([40, 3], VOCAB, seed=8)
    results = run_engine(core, [scoring(f"z{i}", p, max_tokens=0) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        (out,) = results[f"z{i}"]
        assert out.new_token_ids == [] and out.finish_reason == FinishReason.LENGTH
        assert_matches_hf(hf, p, out.prompt_logprobs)


def test_resumed_request_sends_no_prompt_logprobs_again(tiny) -> None:
    _, path = tiny
    core = EngineCore(fp32_config(model=path))
    prompt = random_prompts([20], VOCAB, seed=9)[0]
    full = run_engine(core, [scoring("full", prompt, max_tokens=6)])["full"]
    tokens = [t for o in full for t in o.new_token_ids]
    resumed = run_engine(core, [scoring("again", prompt, max_tokens=6, output_token_ids=tokens[:2])])["again"]
    assert all(o.prompt_logprobs is None for o in resumed)
    assert tokens[:2] + [t for o in resumed for t in o.new_token_ids] == tokens


def test_bad_values_are_refused_by_the_engine(tiny) -> None:
    _, path = tiny
    core = EngineCore(fp32_config(model=path))
    results = run_engine(core, [scoring("big", [1, 2, 3], k=21), scoring("neg", [1, 2, 3], k=-1)])
    assert all(outs[0].finish_reason == FinishReason.ERROR for outs in results.values())


def test_plain_steps_do_no_prompt_logprob_work(tiny, monkeypatch) -> None:
    _, path = tiny
    core = EngineCore(fp32_config(model=path))

    def forbidden(*args, **kwargs):
        raise AssertionError("prompt logprobs scored in a step where nobody asked")

    monkeypatch.setattr(model_runner, "score_prompts", forbidden)
    reqs = [EngineRequest(f"q{i}", p, SamplingParams(max_tokens=4, temperature=0.0, logprobs=2))
            for i, p in enumerate(random_prompts([5, 30], VOCAB, seed=10))]  # fmt: skip
    results = run_engine(core, reqs)
    assert all(o.finish_reason is not FinishReason.ERROR for outs in results.values() for o in outs)


# ---- the API, over HTTP (the shared fp32 server on the default model) ----


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoModelForCausalLM

    from tests.engine_helpers import model_dir, tokenizer

    return tokenizer(), AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32).eval()


def post(server: Server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=120)


def test_echo_logprobs_as_lm_eval_reads_them(server: Server, smol) -> None:
    """lm-evaluation-harness's local-completions: token-id prompts, batched, echo, logprobs 1, max_tokens 1."""
    tok, hf = smol
    texts = ["The capital of France is Paris.", "Bread is made from flour, water, salt and yeast.", "Hi"]
    prompts = [tok(t)["input_ids"] for t in texts]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    choices = post(server, "/v1/completions", body).raise_for_status().json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for prompt, c in zip(prompts, choices, strict=True):
        lp = c["logprobs"]
        n = len(prompt) + 1  # the prompt, then the generated token
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert c["text"].startswith(tok.decode(prompt))
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        own = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert len(own) == 0 or (torch.tensor(lp["token_logprobs"][1:-1]) - own).abs().max() < TOL
        for i, top in enumerate(lp["top_logprobs"][1:-1]):
            # The prompt token first, then the top 1 (OpenAI: up to logprobs + 1 entries). lm-eval's is_greedy: the
            # token's logprob equals max(top.values()) exactly.
            greedy = int(ref[i].argmax()) == prompt[i + 1]
            assert len(top) == (1 if greedy else 2) and next(iter(top)) == lp["tokens"][i + 1]
            assert (lp["token_logprobs"][i + 1] == max(top.values())) == greedy


def test_max_tokens_zero_scores_the_prompt(server: Server) -> None:
    prompt = "Once upon a time, there was a dragon who"
    score = {"echo": True, "logprobs": 2, "max_tokens": 0}
    r = post(server, "/v1/completions", {"prompt": prompt, **score}).raise_for_status().json()
    assert r["usage"]["completion_tokens"] == 0
    (first,) = r["choices"]
    assert first["text"] == prompt and first["finish_reason"] == "length"
    assert len(first["logprobs"]["tokens"]) == r["usage"]["prompt_tokens"]
    assert all(len(t) in (2, 3) for t in first["logprobs"]["top_logprobs"][1:])  # the prompt token's, the top 2
    r = post(server, "/v1/completions", {"prompt": [[1, 2, 3], [4]], **score}).raise_for_status().json()
    assert [len(c["logprobs"]["token_logprobs"]) for c in r["choices"]] == [3, 1]
    assert all(c["logprobs"]["token_logprobs"][0] is None and c["finish_reason"] == "length" for c in r["choices"])
    plain = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0}).raise_for_status().json()
    assert plain["choices"][0]["text"] == "" and plain["choices"][0]["finish_reason"] == "length"


def test_streamed_echo_carries_the_prompt_logprobs_first(server: Server) -> None:
    body = {"prompt": "The sea is", "echo": True, "logprobs": 0, "max_tokens": 3, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    import json

    chunks = [json.loads(line)["choices"][0] for line in lines]
    assert chunks[0]["text"].startswith("The sea is") and chunks[0]["logprobs"]["token_logprobs"][0] is None
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert len(tokens) == 3 + 3 and offsets == sorted(offsets)
    assert "".join(c["text"] for c in chunks) == "".join(tokens)


def test_vllm_prompt_logprobs_on_completions_and_chat(server: Server) -> None:
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    ids = post(server, "/tokenize", {"messages": messages}).raise_for_status().json()["tokens"]
    chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 3})
    cmpl = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 3, "echo": True,
                                            "logprobs": 1})  # fmt: skip
    echo = cmpl.raise_for_status().json()["choices"][0]["logprobs"]["token_logprobs"]
    # vLLM's shapes: once at the top level of a chat response, per choice on completions.
    assert "prompt_logprobs" not in chat.raise_for_status().json()["choices"][0]
    for plp in (chat.json()["prompt_logprobs"], cmpl.json()["choices"][0]["prompt_logprobs"]):
        assert len(plp) == len(ids) and plp[0] is None
        for i, entry in enumerate(plp[1:], start=1):
            own = entry[str(ids[i])]
            assert own["logprob"] == pytest.approx(echo[i], abs=1e-6) and own["rank"] >= 1
            top = sorted((e for e in entry.values()), key=lambda e: e["rank"])[:3]
            assert [e["rank"] for e in top] == [1, 2, 3] and all(isinstance(e["decoded_token"], str) for e in top)
            assert len(entry) in (3, 4) and (len(entry) == 3) == (own["rank"] <= 3)


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -2}),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}),  # the whole vocabulary: past --max-logprobs 20
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    ("/v1/completions", {"prompt": [5] * 2048, "max_tokens": 0, "echo": True, "logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 2, "stream": True}),
])  # fmt: skip
def test_bad_values_are_400(server: Server, route: str, body: dict) -> None:
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
