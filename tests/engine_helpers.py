"""Shared by the engine tests: real prompts of mixed lengths, an in-process engine driver, HF references."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import EngineConfig
from common.messages import EngineOutput, EngineRequest, FinishReason, SamplingParams
from common.model_source import resolve_model
from engine_core.core import EngineCore

CORPUS = """The history of the lighthouse begins with fires lit on hills to guide ships home. Later, towers
were built so the light could be seen from farther out at sea, and mirrors were added to gather it.
In the nineteenth century, the Fresnel lens changed everything: a set of glass rings bent the light
into a single strong beam that could reach the horizon. Keepers lived in small houses beside the
towers, trimming wicks, polishing brass, and writing the weather into a log every few hours. Storms
were the hardest part of the job, because the light had to burn all night no matter what the sea did.
Today most lighthouses run by themselves, powered by electricity and watched from far away, yet many
people still visit them to climb the stairs and look out over the water. Bread is made from flour,
water, salt and yeast. The yeast eats sugars in the flour and releases gas, which makes the dough rise.
Kneading builds gluten, a network of proteins that traps the gas and gives bread its chewy texture.
A slow rise in a cool kitchen develops more flavour than a fast one in a warm place. Bakers often
keep a starter, a living culture of wild yeast and bacteria, which they feed every day with flour and
water. The crust forms in the oven as the surface dries and browns, and steam in the first minutes
keeps it thin and crisp. Python is a programming language that many people learn first. Its syntax
is simple, and it has a large standard library for files, networks, and text. Lists, dictionaries and
sets are built in, and functions are values that can be passed around like any other object."""

LENGTHS = [5, 9, 14, 22, 31, 47, 64, 80, 101, 127, 150, 175, 203, 231, 266, 300]


@functools.cache
def model_dir():
    return resolve_model(None).path


@functools.cache
def tokenizer():
    return AutoTokenizer.from_pretrained(model_dir())


@functools.cache
def mixed_prompts() -> list[list[int]]:
    """16 prompts of 5 to 300 tokens: different slices of the corpus, so they share few prefixes."""
    ids = tokenizer()(CORPUS)["input_ids"]
    assert len(ids) > 300
    return [ids[(i * 37) % (len(ids) - n) :][:n] for i, n in enumerate(LENGTHS)]


def hf_greedy(prompts: list[list[int]], max_new: int, model=None) -> list[tuple[list[int], list[list[int]]]]:
    """transformers' own greedy generate, the prompts batched with left padding as HF users batch them (on this CPU
    the same tokens as one prompt at a time, in a quarter of the time): tokens and top-2 per step. The default
    model in fp32 unless `model` is given."""
    model = model or AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, min_new_tokens=max_new,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    top2 = torch.stack(out.scores, dim=1).topk(2).indices  # [prompt, step, 2]
    return [(out.sequences[i, width:].tolist(), top2[i].tolist()) for i in range(len(prompts))]


def assert_matches_hf(ours: list[list[int]], refs, max_flips: int = 1) -> None:
    """Equal token for token; a divergence counts as a tolerated near-tie flip only if our token is HF's
    second choice there, and at most max_flips prompts may have one."""
    flips = 0
    for i, (tokens, (ref, top2)) in enumerate(zip(ours, refs, strict=True)):
        assert len(tokens) == len(ref), f"prompt {i}: {len(tokens)} tokens, HF {len(ref)}"
        diverged = next((j for j, (a, b) in enumerate(zip(tokens, ref, strict=True)) if a != b), None)
        if diverged is None:
            continue
        assert tokens[diverged] == top2[diverged][1], f"prompt {i} differs at {diverged} beyond a near-tie"
        flips += 1
    assert flips <= max_flips, f"{flips} prompts flipped a near-tie"


# On a GPU, test engines get a fixed small KV cache instead of profiling --gpu-memory-utilization (90%) of the
# card: several engines live in one test process (whose CUDA allocator keeps what they freed), servers beside it.
GPU_TEST_KV: dict = {"num_kv_blocks": 1024} if torch.cuda.is_available() else {}


def engine_config(**kw) -> EngineConfig:
    """A test engine's config: on a GPU the fixed KV cache above, unless kw names its own."""
    return EngineConfig(**{**GPU_TEST_KV, **kw})


def fp32_config(**kw) -> EngineConfig:
    return engine_config(**{"dtype": "float32", "kv_cache_memory": 0.5, **kw})


def greedy_request(rid: str, prompt: list[int], max_tokens: int, **kw) -> EngineRequest:
    # min_tokens holds EOS back as HF's min_new_tokens does, so both produce max_tokens comparable tokens.
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, min_tokens=max_tokens, **kw)
    return EngineRequest(rid, prompt, params)


def run_engine(core: EngineCore, requests: list[EngineRequest], stagger: int = 0) -> dict[str, list[EngineOutput]]:
    """Steps an in-process engine until every request finished, checking the KV invariant after each step.
    With stagger=k, requests arrive k at a time, one batch every 3 steps, while earlier ones decode. The outputs of
    requests added to the engine before come back too."""
    pending = list(requests)
    results: dict[str, list[EngineOutput]] = {r.request_id: [] for r in requests}
    step = 0
    while pending or core.has_work:
        if pending and (not stagger or step % 3 == 0):
            batch, pending = (pending[:stagger], pending[stagger:]) if stagger else (pending, [])
            for r in batch:
                core.add_request(r)
        for out in core.step():
            results.setdefault(out.request_id, []).append(out)
        core.kv.check_integrity(list(core.scheduler.requests.values()))
        step += 1
    assert core.kv.num_used_blocks == 0
    return results


def tokens_of(results: dict[str, list[EngineOutput]], ids: list[str]) -> list[list[int]]:
    return [[t for out in results[rid] for t in out.new_token_ids] for rid in ids]


def save_tiny_llama(path, max_positions: int, init: float) -> str:
    """A 2-layer random Llama (vocab 300, GQA 4:2 heads of 16) saved as an HF directory; seeded, so the same
    arguments give the same weights."""
    from transformers import LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         eos_token_id=3, initializer_range=init)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def drive(mode: str, model: str, reqs: list[EngineRequest], abort_at: dict[int, str] | None = None,
          logprobs: dict | None = None, prepare: Callable[[EngineCore], None] | None = None, **kw):  # fmt: skip
    """An fp32 engine with --overlap-decode `mode` (and EngineConfig `kw`; `prepare` may change it before the first
    step): adds a request every other step, aborts as asked (step -> id), checks the KV invariant after every step,
    and that no block leaked, no overlapped launch failed (the pipeline would hide it by going synchronous) and every
    request finished. Returns tokens and finish reasons per request, the launches that chained on one in flight, and
    the preemptions, the aborts of requests that were in flight and the requests admitted into launches that
    chained. `logprobs` collects each request's logprobs per output."""
    core = EngineCore(engine_config(model=model, dtype="float32", overlap_decode=mode, **kw))
    if prepare is not None:
        prepare(core)
    chained = aborted_in_flight = admitted = 0
    failures: list[Exception] = []
    if core.pipeline is not None:
        launch = core.runner.launch

        def counting(out, prev=None):
            nonlocal chained, admitted
            assert out.total_tokens <= core.scheduler.max_num_batched_tokens, "a launched step over the budget"
            chained += prev is not None
            if prev is not None:  # requests admitted into a step launched while another was in flight
                admitted += len({id(r) for r in out.requests} - {id(r) for r in prev.sched.requests})
            try:
                return launch(out, prev)
            except Exception as exc:  # the pipeline recovers by going synchronous, but a launch must not fail
                failures.append(exc)
                raise

        core.runner.launch = counting  # type: ignore[method-assign]
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    reasons: dict[str, FinishReason] = {}
    pending, step = list(reqs), 0
    while pending or core.has_work:
        if pending and step % 2 == 0:
            core.add_request(pending.pop(0))
        if abort_at and step in abort_at:
            flying = core._in_flight.requests if core._in_flight is not None else []
            aborted_in_flight += any(r.request_id == abort_at[step] for r in flying)
            core.abort([abort_at[step]])
        for out in core.step():
            assert out.request_id not in reasons, f"{out.request_id}: an output after its last"
            tokens[out.request_id] += out.new_token_ids
            if logprobs is not None:
                logprobs.setdefault(out.request_id, []).append(out.new_logprobs)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
        core.kv.check_integrity(list(core.scheduler.requests.values()))
        step += 1
        assert step < 5000, "the engine stopped making progress"  # these workloads take a few hundred steps
    assert core.kv.pool.num_free == core.kv.num_blocks, "blocks leaked"
    assert not failures, f"overlapped launches failed: {failures}"
    assert set(reasons) | set((abort_at or {}).values()) == set(tokens), "a request never finished"
    return tokens, reasons, chained, (core.scheduler.num_preempted, aborted_in_flight, admitted)


def counting_calls(counts: dict[str, int], method: str) -> Callable[[EngineCore], None]:
    """A `drive` hook that counts the calls of the model runner's `method` in counts[method] (the steps executed
    synchronously: "execute"; the launched steps sampled after an update: "sample_late")."""

    def prepare(core: EngineCore) -> None:
        original = getattr(core.runner, method)

        def counted(*args):
            counts[method] += 1
            return original(*args)

        setattr(core.runner, method, counted)

    return prepare


def assert_serves_hf_greedy(model_dir, model, prompts: list[list[int]], max_new: int = 12, **config) -> None:
    """Our engine on `model_dir` (fp32; `config`: more EngineConfig fields) gives transformers' `model`'s own greedy
    tokens for each prompt, all in one batch."""
    engine = EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256, **config)
    requests = [greedy_request(f"r{i}", p, max_new) for i, p in enumerate(prompts)]
    ours = tokens_of(run_engine(EngineCore(engine), requests), [r.request_id for r in requests])
    with torch.inference_mode():
        refs = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)[0, len(p) :].tolist()
                for p in prompts]  # fmt: skip
    assert ours == refs
