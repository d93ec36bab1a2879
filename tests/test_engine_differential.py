"""The engine as CUDA runs it by default (overlapped decode, decode graphs, steps with prompt tokens replayed as
decode rows) against the plain synchronous engine without graphs, over random workloads: the same tokens and
finish reasons, no overlapped launch that fails (the pipeline would hide it by going synchronous), the KV
invariant after every step, and no leaked block. On the CPU the graph runner runs its buffers eagerly
(capture=False) and a launch runs at once, so this checks the bookkeeping the GPU path relies on.

Workloads mix greedy and seeded sampled requests, stop ids, logprobs, prompt logprobs, penalties, min_tokens,
resumed requests (outputs already streamed), shared prefixes, aborts, small KV pools (preemption), small budgets
(chunked prompts) and few seats."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from common.messages import EngineRequest, SamplingParams
from engine_core.core import EngineCore
from engine_core.cuda_graphs import DecodeGraphs, graph_rows
from tests.engine_helpers import drive, save_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-differential"), max_positions=1024, init=0.2)


def workload(seed: int) -> tuple[list[EngineRequest], dict[int, str], dict]:
    rng = random.Random(seed)
    token = lambda: rng.randrange(4, 250)  # noqa: E731
    shared = [token() for _ in range(rng.choice([0, 8, 16]))]
    reqs = []
    for i in range(rng.randrange(3, 12)):
        kw: dict = {"max_tokens": rng.randrange(1, 40), "temperature": rng.choice([0.0, 0.8]), "seed": i,
                    "ignore_eos": True}  # fmt: skip
        for field, value, chance in (("logprobs", 1, 0.15), ("stop_token_ids", list(range(40, 60)), 0.2),
                                     ("prompt_logprobs", 1, 0.1), ("repetition_penalty", 1.2, 0.1),
                                     ("min_tokens", 3, 0.1)):  # fmt: skip
            if rng.random() < chance:
                kw[field] = value
        streamed = [token() for _ in range(rng.choice([0, 0, 0, 3]))]
        prompt = shared + [token() for _ in range(rng.randrange(1, 30))]
        reqs.append(EngineRequest(f"r{i}", prompt, SamplingParams(**kw), output_token_ids=streamed))
    config = {"block_size": rng.choice([4, 8]), "num_kv_blocks": rng.choice([24, 40, 200]), "max_model_len": 96,
              "max_num_batched_tokens": rng.choice([16, 32, 64, 256]), "max_num_seqs": rng.choice([2, 4, 16]),
              "enable_prefix_caching": rng.random() < 0.8}  # fmt: skip
    config["num_kv_blocks"] = max(config["num_kv_blocks"], 96 // config["block_size"] + 2)
    aborts = {rng.randrange(3, 30): f"r{rng.randrange(len(reqs))}"} if rng.random() < 0.3 else {}
    return reqs, aborts, config


def install_graphs(counts: dict[str, int]) -> Callable[[EngineCore], None]:
    """As a CUDA engine starts: decode graphs up to the mixed-step rows, run eagerly here; replays counted."""

    def prepare(core: EngineCore) -> None:
        runner, config = core.runner, core.config
        width = -(-core.max_model_len // config.block_size)
        graphs = DecodeGraphs(runner.model, graph_rows(runner.config), width, runner.scratch_slot, config.block_size,
                              runner.device, runner.attn_backend.index_dtype, capture=False)  # fmt: skip
        graphs.capture_all()
        runner.decode_graphs = graphs
        replay = graphs.run

        def counted(input_ids, positions, meta):
            counts["replays"] += 1
            return replay(input_ids, positions, meta)

        graphs.run = counted  # type: ignore[method-assign]

    return prepare


# Seeds whose workloads chain many launches, replay prompt rows, preempt, chunk and abort between them.
@pytest.mark.parametrize("seed", [8, 10, 12, 14, 19, 27])
def test_cuda_default_path_matches_the_plain_engine(tiny_dir, seed) -> None:
    reqs, aborts, config = workload(seed)
    on_cpu = {"device": "cpu", "attention_backend": "torch", **config}
    want_tokens, want_reasons, _, _ = drive("off", tiny_dir, reqs, aborts, **on_cpu)
    counts = {"replays": 0}
    tokens, reasons, chained, _ = drive("on", tiny_dir, reqs, aborts, prepare=install_graphs(counts), **on_cpu)
    assert chained > 10 and counts["replays"] > 20, (chained, counts)
    for rid, want in want_tokens.items():
        if rid in aborts.values():  # stopped where it was: an overlapped engine answers a step later
            assert want[: len(tokens[rid])] == tokens[rid] or tokens[rid][: len(want)] == want, rid
        else:
            assert (tokens[rid], reasons[rid]) == (want, want_reasons[rid]), rid
