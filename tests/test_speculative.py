"""N-gram speculative decoding: the proposer, the config, and an engine whose tokens equal decoding one at a time."""

from __future__ import annotations

import msgspec
import pytest

from common.config import SpeculativeConfig
from common.messages import EngineRequest, FinishReason, SamplingParams
from engine_core.core import EngineCore
from engine_core.request import Request
from engine_core.speculative import NgramIndex, Speculator
from tests.engine_helpers import engine_config, run_engine, save_tiny_llama, tokens_of

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'


def test_the_index_proposes_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # The trailing (2, 3) last occurred at 5-6 (followed by 7, 8, 5, 2); (5, 2, 3) never did before.
    assert index.propose(tokens, 4) == [7, 8, 5, 2]
    assert index.propose(tokens, 2) == [7, 8]
    tokens += [4]  # 4 never occurred before: no match of any length
    assert index.propose(tokens, 4) == []
    tokens += [1, 2]  # (4, 1, 2) no, (1, 2) yes: the latest is at 4-5, followed by 3, 7, 8, 5
    assert index.propose(tokens, 4) == [3, 7, 8, 5]
    fresh = NgramIndex(1, 3)  # built at once equals built a token at a time
    assert fresh.propose(tokens, 4) == [3, 7, 8, 5]


def test_the_index_never_matches_the_trailing_ngram_itself() -> None:
    assert NgramIndex(1, 2).propose([5, 6, 7], 3) == []
    assert NgramIndex(1, 1).propose([5, 5], 3) == [5]  # the earlier 5 is followed by the trailing one


def test_config_parses_vllm_keys_and_names_what_is_wrong() -> None:
    assert SpeculativeConfig.parse(None) is None
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert spec == SpeculativeConfig(5, 2, 4, None)
    for text, words in [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "eagle"),
        ('{"prompt_lookup_max": 3}', "num_speculative_tokens"),
        ('{"num_speculative_tokens": 99}', "[1, 16]"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "must not exceed"),
        ('{"num_speculative_tokens": 2, "draft_model": "x"}', "unknown keys ['draft_model']"),
        ('{"num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size"),
    ]:
        with pytest.raises(ValueError, match=None) as err:
            SpeculativeConfig.parse(text)
        assert words in str(err.value), (text, err.value)


def test_drafts_only_once_the_prompt_is_computed() -> None:
    """The last prompt token runs as prefill (Request.decoding), so no draft rides beside it; its first decode may."""
    speculator = Speculator.build(SPEC, max_model_len=256)
    assert speculator is not None
    speculator.start_step(num_running=1)
    req = Request(EngineRequest("r", [1, 2, 3, 9, 1, 2], SamplingParams(max_tokens=8)), 0)
    req.num_computed_tokens = 5  # a chunk budget left the last prompt token for this step
    assert speculator.draft(req, budget=100) == []
    req.token_ids.append(3)
    req.num_computed_tokens = 6
    assert speculator.draft(req, budget=100) == [9, 1, 2, 3]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    # Small weights: its greedy text falls into loops, as real text repeats itself, so drafts get kept.
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-spec"), max_positions=256, init=0.05)


def prompts() -> list[list[int]]:
    """Repetitive prompts (something to look up) of lengths around block boundaries, and one without repeats."""
    motif = [11, 12, 13, 14, 15, 16, 17]
    return [(motif * 6)[:n] for n in (15, 16, 17, 33, 40)] + [list(range(20, 60))]


def run(tiny_dir: str, dtype: str, spec: str | None, requests: list[EngineRequest], stagger: int = 2, **kw):
    config = engine_config(model=tiny_dir, dtype=dtype, kv_cache_memory=0.05, max_num_seqs=8,
                           speculative_config=spec, **kw)  # fmt: skip
    core = EngineCore(config)
    results = run_engine(core, requests, stagger=stagger)
    return results, core.scheduler.stats()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])  # bf16: the C decode stack; fp32: the Python layers
def test_greedy_tokens_equal_decoding_one_at_a_time(tiny_dir: str, dtype: str) -> None:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (40, 7, 1, 25, 60, 30)]
    params[4] = msgspec.structs.replace(params[4], logprobs=2)
    requests = [EngineRequest(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts(), params, strict=True))]
    ids = [r.request_id for r in requests]
    first, _ = run(tiny_dir, dtype, None, requests)
    stop = tokens_of(first, ["r3"])[0][12]  # a stop id that comes up mid-way, inside a draft once speculating
    requests[3].params = msgspec.structs.replace(params[3], stop_token_ids=[stop])
    plain, _ = run(tiny_dir, dtype, None, requests)
    spec, stats = run(tiny_dir, dtype, SPEC, requests)
    assert tokens_of(spec, ids) == tokens_of(plain, ids)
    assert stats.num_accepted_tokens > 40 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert len(spec["r0"]) <= 0.8 * len(plain["r0"])  # outputs of several tokens
    assert plain["r3"][-1].stop_token_id == spec["r3"][-1].stop_token_id == stop
    assert spec["r3"][-1].finish_reason == plain["r3"][-1].finish_reason == FinishReason.STOP
    ours = [lp for o in spec["r4"] for lp in o.new_logprobs.token_logprobs]  # type: ignore[union-attr]
    theirs = [lp for o in plain["r4"] for lp in o.new_logprobs.token_logprobs]  # type: ignore[union-attr]
    tops = [ids for o in spec["r4"] for ids in o.new_logprobs.top_ids]  # type: ignore[union-attr]
    assert len(ours) == 60 and ours == pytest.approx(theirs, abs=1e-5) and all(len(t) == 2 for t in tops)


def test_seeded_draws_equal_decoding_one_at_a_time(tiny_dir: str) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.5, top_k=2, seed=5, ignore_eos=True)  # often the draft
    requests = [EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts())]
    ids = [r.request_id for r in requests]
    plain, _ = run(tiny_dir, "bfloat16", None, requests)
    spec, stats = run(tiny_dir, "bfloat16", SPEC, requests)
    assert tokens_of(spec, ids) == tokens_of(plain, ids)
    assert stats.num_accepted_tokens > 0


def test_memory_pressure_limits_and_ineligible_requests(tiny_dir: str) -> None:
    """A cache that preempts, a context limit reached mid-draft, a penalty (decodes one at a time) and a batch
    limit: the same tokens as without speculation, and no block left behind (run_engine checks each step)."""
    motif = [11, 12, 13, 14, 15, 16, 17]
    requests = [EngineRequest(f"r{i}", (motif * 9)[: 20 + i], SamplingParams(max_tokens=80, temperature=0.0,
                                                                           ignore_eos=True))
                for i in range(6)]  # fmt: skip
    requests.append(EngineRequest("pen", motif * 3, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                                   repetition_penalty=1.2)))  # fmt: skip
    ids = [r.request_id for r in requests]
    small = {"num_kv_blocks": 14, "max_model_len": 96}  # 7 requests of up to 96 tokens in 14 blocks of 16
    plain, plain_stats = run(tiny_dir, "bfloat16", None, requests, stagger=3, **small)
    spec, stats = run(tiny_dir, "bfloat16", SPEC, requests, stagger=3, **small)
    assert tokens_of(spec, ids) == tokens_of(plain, ids)
    assert plain_stats.num_preempted > 0 and stats.num_accepted_tokens > 0
    assert {o.finish_reason for r in ids for o in spec[r] if o.finish_reason} == {
        o.finish_reason for r in ids for o in plain[r] if o.finish_reason
    }
    limited = SPEC.replace("}", ', "disable_by_batch_size": 1}')
    _, none = run(tiny_dir, "bfloat16", limited, requests[:3], stagger=0)  # three at once: never one running
    assert none.num_draft_tokens == 0


def test_drafts_stay_within_the_rows_of_a_step(tiny_dir: str) -> None:
    """Running requests plus draft rows never pass max_rows_per_step: beyond the rows a step takes for about the
    price of one, drafts would cost arithmetic."""
    config = engine_config(model=tiny_dir, dtype="bfloat16", kv_cache_memory=0.05, max_num_seqs=8,
                           speculative_config=SPEC.replace("}", ', "max_rows_per_step": 6}'))  # fmt: skip
    core = EngineCore(config)
    schedule, seen = core.scheduler.schedule, []

    def recording():
        out = schedule()
        seen.append((len(core.scheduler.running), sum(len(r.draft_token_ids) for r in out.requests)))
        return out

    core.scheduler.schedule = recording  # type: ignore[method-assign]
    motif = [11, 12, 13, 14, 15, 16, 17]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    run_engine(core, [EngineRequest(f"r{i}", motif * (2 + i), params) for i in range(3)])
    assert all(running + rows <= 6 for running, rows in seen), seen
    assert max(rows for _, rows in seen) >= 3  # the rows left were used (three running: three; fewer: more)
    with pytest.raises(ValueError, match="max_rows_per_step"):
        SpeculativeConfig.parse('{"num_speculative_tokens": 2, "max_rows_per_step": 0}')


def test_launch_refuses_a_bad_config_before_starting_anything(capsys) -> None:
    import launch

    assert launch.main(["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}']) == 2
    assert "method 'eagle' is not supported" in capsys.readouterr().err
