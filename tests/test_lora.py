"""LoRA adapters in the engine: each adapter's rows answer as transformers with that adapter merged into its weights,
beside base-model rows and other adapters' in the same steps; the prefix cache keeps adapters apart; bad adapters
and flags fail at start with the reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from bench.make_random_lora import ALL, write_adapter
from common.config import EngineConfig
from common.lora import ADAPTER_WEIGHTS, LEGACY_WEIGHTS, lora_modules
from common.messages import EngineRequest, LoraRef, SamplingParams
from engine_core.core import EngineCore
from engine_core.lora import LoraAdapters
from engine_core.models.loader import load_model
from tests.engine_helpers import (
    assert_matches_hf,
    engine_config,
    fp32_config,
    hf_greedy,
    mixed_prompts,
    model_dir,
    run_engine,
    tokens_of,
)
from tests.lora_helpers import MAX_NEW, lora_request, merged, refs, tiny_model_and_adapters, tiny_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_and_adapters(tmp_path_factory.mktemp("lora"))


def test_adapters_match_merged_weights_beside_the_base_model(tiny):
    """Base, `every` and `qv` requests arrive staggered, prefill in chunks beside each other's decodes: each matches
    transformers with its own adapter merged (the base: no adapter)."""
    model, adapters = tiny
    config = fp32_config(model=model, enable_lora=True, max_num_batched_tokens=40,
                         lora_modules=[f"{name}={path}" for name, path in adapters.items()])  # fmt: skip
    core, served = EngineCore(config), refs(config)
    prompts = tiny_prompts()
    requests = [lora_request(f"{lora or 'base'}-{i}", p, served.get(lora)) for i, p in enumerate(prompts)
                for lora in ("", "every", "qv")]  # fmt: skip
    results = run_engine(core, requests, stagger=4)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    references = {"base": hf, **{name: merged(hf, path) for name, path in adapters.items()}}
    ours: dict[str, list[list[int]]] = {}
    for name, reference in references.items():
        ours[name] = tokens_of(results, [f"{name}-{i}" for i in range(len(prompts))])
        assert_matches_hf(ours[name], hf_greedy(prompts, MAX_NEW, reference), max_flips=0)
    for name in adapters:  # each adapter changes the answers (else the test above could not tell)
        assert sum(a != b for a, b in zip(ours[name], ours["base"], strict=True)) >= len(prompts) // 2


def test_speculative_drafts_of_adapter_rows_keep_their_adapter(tiny):
    """N-gram drafts are decode rows of their request: verified under its adapter, they change no token."""
    model, adapters = tiny
    motif = [11, 12, 13, 14, 15, 16, 17]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)  # no min_tokens: it would bar drafts
    flags = {"model": model, "enable_lora": True, "lora_modules": [f"every={adapters['every']}"]}
    every = refs(fp32_config(**flags))["every"]
    requests = [EngineRequest(f"{'every' if lora else 'base'}-{i}", (motif * 6)[i:], params, lora=lora)
                for i in range(4) for lora in (every, None)]  # fmt: skip
    ids = [r.request_id for r in requests]
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    plain = run_engine(EngineCore(fp32_config(**flags)), requests)
    core = EngineCore(fp32_config(speculative_config=spec, **flags))
    drafted = run_engine(core, requests, stagger=2)
    assert tokens_of(drafted, ids) == tokens_of(plain, ids)
    assert core.scheduler.stats().num_accepted_tokens > 0
    assert tokens_of(plain, ids[0::2]) != tokens_of(plain, ids[1::2])  # the adapter's answers are its own


def test_prefix_cache_keeps_adapters_apart(tiny):
    """The same prompt under another adapter reuses none of the K/V; under the same adapter it does."""
    model, adapters = tiny
    config = fp32_config(model=model, enable_lora=True, lora_modules=[f"every={adapters['every']}"])
    core, every = EngineCore(config), refs(config)["every"]
    prompt = tiny_prompts()[-1]  # 70 tokens: four full blocks of 16

    def cached(rid: str, lora: LoraRef | None) -> tuple[int, list[int]]:
        outputs = run_engine(core, [lora_request(rid, prompt, lora)])[rid]
        return outputs[0].num_cached_tokens, [t for o in outputs for t in o.new_token_ids]

    base_cached, base_tokens = cached("base", None)
    assert base_cached == 0
    first_cached, first_tokens = cached("every-1", every)
    assert first_cached == 0 and first_tokens != base_tokens
    assert cached("every-2", every) == (64, first_tokens)
    assert cached("base-2", None) == (64, base_tokens)


def test_pefts_older_bin_format_answers_as_safetensors(tiny, tmp_path):
    """adapter_model.bin, read with torch.load(weights_only=True): the same adapter, the same tokens."""
    model, adapters = tiny
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(Path(adapters["qv"]) / "adapter_config.json", legacy)
    torch.save(load_file(str(Path(adapters["qv"]) / ADAPTER_WEIGHTS)), legacy / LEGACY_WEIGHTS)
    config = fp32_config(model=model, enable_lora=True, lora_modules=[f"new={adapters['qv']}", f"old={legacy}"])
    core, served = EngineCore(config), refs(config)
    prompts = tiny_prompts()[:3]
    results = run_engine(core, [lora_request(f"{name}-{i}", p, served.get(name)) for i, p in enumerate(prompts)
                                for name in ("new", "old", "")])  # fmt: skip
    for i in range(len(prompts)):
        new, old = tokens_of(results, [f"new-{i}", f"old-{i}"])
        assert new == old and len(new) == MAX_NEW
    assert any(tokens_of(results, [f"new-{i}"]) != tokens_of(results, [f"-{i}"]) for i in range(len(prompts)))


@pytest.fixture(scope="module")
def smol_bf16(tmp_path_factory):
    """The default model in bf16 (packed linears, the one-call decode stack where this CPU runs it) with an adapter
    on all seven linears."""
    config = AutoConfig.from_pretrained(model_dir())
    adapter = write_adapter(tmp_path_factory.mktemp("smol-lora"), config, ALL, rank=8, alpha=8, seed=3, std=0.04)
    core = EngineCore(engine_config(dtype="bfloat16", kv_cache_memory=0.5, enable_lora=True,
                                    lora_modules=[f"smol={adapter}"]))  # fmt: skip
    return core, adapter


SMOL = LoraRef(1, "smol", "")  # loaded at start: the engine needs no path for it


def _forced_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.inference_mode():
        logprobs = model(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
    return [logprobs[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]


def test_bf16_adapter_matches_merged_weights(smol_bf16):
    """Each generated token's logprob, against transformers' fp32 with the adapter merged and without it. In bf16 the
    greedy tokens flip at near-ties as often with as without an adapter, so the logprobs are what tells: a decode
    step that kept the decode stack (the base weights only) lands near the base model's (mean error 0.084 against
    the merged model's, 0.090 against the base's, when tried)."""
    core, adapter = smol_bf16
    prompts = mixed_prompts()[::3]
    requests = [lora_request(f"smol-{i}", p, SMOL, 16, logprobs=0) for i, p in enumerate(prompts)]
    requests += [lora_request(f"base-{i}", p, None, 16) for i, p in enumerate(prompts)]  # base rows in the same steps
    results = run_engine(core, requests)
    hf = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32).eval()
    reference = merged(hf, adapter)
    to_merged, to_base = [], []
    for i, prompt in enumerate(prompts):
        outputs = results[f"smol-{i}"]
        tokens = [t for o in outputs for t in o.new_token_ids]
        ours = [lp for o in outputs if o.new_logprobs for lp in o.new_logprobs.token_logprobs]
        assert len(ours) == len(tokens) == 16
        to_merged += [abs(a - b) for a, b in zip(ours, _forced_logprobs(reference, prompt, tokens), strict=True)]
        to_base += [abs(a - b) for a, b in zip(ours, _forced_logprobs(hf, prompt, tokens), strict=True)]
    error, base_error = sum(to_merged) / len(to_merged), sum(to_base) / len(to_base)
    assert error < 0.05 and error < base_error / 2, (error, base_error)  # 0.030 against 0.106 when written


def test_bf16_seeded_adapter_rows_do_not_depend_on_the_batch(smol_bf16):
    """On CUDA in fp32, as test_engine_zmq's check of the base model: cuBLAS picks bf16 kernels by row count."""
    core, adapter = smol_bf16
    if torch.cuda.is_available():
        core = EngineCore(engine_config(dtype="float32", kv_cache_memory=0.5, enable_lora=True,
                                        lora_modules=[f"smol={adapter}"]))  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=7, ignore_eos=True)
    prompt = mixed_prompts()[4]
    alone = run_engine(core, [EngineRequest("alone", prompt, params, lora=SMOL)])
    others = [EngineRequest(f"o{i}", p, params, lora=SMOL if i % 2 else None) for i, p in enumerate(mixed_prompts())]
    crowd = run_engine(core, [*others[:5], EngineRequest("crowd", prompt, params, lora=SMOL), *others[5:]])
    assert tokens_of(alone, ["alone"]) == tokens_of(crowd, ["crowd"])


def test_bf16_adapter_loaded_at_run_time_answers_as_one_loaded_at_start(smol_bf16, tmp_path):
    """The decode stack takes an adapter loaded while the engine runs (and lets one go when unloaded): a copy of the
    start's adapter, loaded later, gives the same tokens bit for bit, and the start's still does afterwards."""
    core, adapter = smol_bf16
    copy = LoraRef(2, "copy", str(shutil.copytree(adapter, tmp_path / "copy")))
    prompts = mixed_prompts()[1::4]

    def answers(lora: LoraRef) -> list[list[int]]:
        results = run_engine(core, [lora_request(f"{lora.name}-{i}", p, lora, 12) for i, p in enumerate(prompts)])
        return tokens_of(results, [f"{lora.name}-{i}" for i in range(len(prompts))])

    before = answers(SMOL)
    assert core.load_lora(copy) is None
    assert core.runner.lora.in_stack == (core.runner.model.decode_stack is not None)
    assert answers(copy) == before
    core.unload_lora(copy)
    assert set(core.runner.lora.names) == {SMOL.id}
    assert answers(SMOL) == before


def _config(entries: list[str], **kw) -> EngineConfig:
    return EngineConfig(**{"enable_lora": True, "lora_modules": entries, **kw})


@pytest.mark.parametrize(("entries", "kw", "settings", "message"), [
    (["a={good}"], {"enable_lora": False}, {}, "needs --enable-lora"),
    (["a={good}"], {"tensor_parallel_size": 2}, {}, "tensor-parallel-size"),
    (["no-equals-sign"], {}, {}, "neither name=path"),
    (['{"name": "a"'], {}, {}, "is not JSON"),
    (["a={good}", "a={good}"], {}, {}, "given twice"),
    (["a={tmp}/missing"], {}, {}, "no such directory"),
    (["a={tmp}/good/adapter_model.safetensors"], {}, {}, "no such directory"),
    (["a={tmp}"], {}, {}, "no adapter_model.safetensors or adapter_model.bin"),
    (["a={good}"], {"max_lora_rank": 4}, {}, "above --max-lora-rank 4"),
    (["a={good}"], {}, {"use_dora": True}, "use_dora"),
    (["a={good}"], {}, {"modules_to_save": ["lm_head"]}, "modules_to_save"),
    (["a={good}"], {}, {"bias": "all"}, "bias"),
])  # fmt: skip
def test_flags_and_adapter_configs_are_checked(tiny, tmp_path, entries, kw, settings, message):
    model, _ = tiny
    good = write_adapter(tmp_path / "good", AutoConfig.from_pretrained(model), ["q_proj"], 8, 8, 0, **settings)
    (tmp_path / "adapter_config.json").write_text((tmp_path / "good" / "adapter_config.json").read_text())
    entries = [e.replace("{good}", good).replace("{tmp}", str(tmp_path)) for e in entries]
    with pytest.raises(ValueError, match=message):
        lora_modules(_config(entries, **kw))


def test_json_form_names_an_adapter(tiny):
    _, adapters = tiny
    entry = json.dumps({"name": "sql", "path": adapters["qv"], "base_model_name": "ignored"})
    assert [(m.name, m.path) for m in lora_modules(_config([entry]))] == [("sql", adapters["qv"])]


@pytest.mark.parametrize(("key", "shape", "message"), [
    ("base_model.model.model.embed_tokens.lora_embedding_A", (8, 300), "not a LoRA weight of a linear layer"),
    ("base_model.model.lm_head.lora_A.weight", (8, 64), "not a decoder layer's linear"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", (8, 65), "the layer takes"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", (8,), "must be matrices"),
])  # fmt: skip
def test_adapter_weights_are_checked_at_load(tiny, tmp_path, key, shape, message):
    """What a config cannot say: weights on layers we do not adapt, or of the wrong shape."""
    model, _ = tiny
    path = write_adapter(tmp_path / "bad", AutoConfig.from_pretrained(model), ["q_proj"], 8, 8, 0)
    weights = {key: torch.zeros(shape)}
    if key.endswith("lora_A.weight"):
        weights[key.replace("lora_A", "lora_B")] = torch.zeros(64, 8)
    save_file(weights, str(tmp_path / "bad" / ADAPTER_WEIGHTS))
    ours = load_model(model, torch.float32, torch.device("cpu"), max_positions=64)
    modules = lora_modules(_config([f"bad={path}"]))
    with pytest.raises(ValueError, match=message):
        LoraAdapters.load(ours, modules, 16, torch.device("cpu"), torch.float32)


def test_gpt2_refuses_adapters(tiny, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    ours = load_model(tmp_path / "gpt2", torch.float32, torch.device("cpu"), max_positions=64)
    modules = lora_modules(_config([f"every={tiny[1]['every']}"]))
    with pytest.raises(ValueError, match="Llama family and Gemma 3, not GPT2LMHeadModel"):
        LoraAdapters.load(ours, modules, 16, torch.device("cpu"), torch.float32)
