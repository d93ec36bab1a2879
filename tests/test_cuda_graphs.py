"""The decode-graph runner's buffers and buckets, run eagerly on CPU (capture=False): the same hidden states as
the plain eager path, while batches shrink and grow across buckets, with every table at the fixed full width and
padding rows of length 0 (on the C-kernel and the torch backends). The capture itself needs a GPU."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.config import EngineConfig
from common.messages import EngineRequest, SamplingParams
from engine_core.core import EngineCore
from engine_core.cuda_graphs import DecodeGraphs, batch_buckets


def test_buckets() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    assert batch_buckets(1024)[-15:] == [240, 248, 256, *range(320, 1025, 64)] and len(batch_buckets(1024)) == 47
    assert batch_buckets(300)[-3:] == [248, 256, 300]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=3, tie_word_embeddings=True, initializer_range=0.3)  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-graphs")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_graph_buffers_match_the_eager_forward(tiny_dir, backend) -> None:
    """Every decode step goes through the graph buffers and, right after, through the plain forward on the
    same inputs (rewriting the same KV): the hidden states of the real rows must agree."""
    device = "cpu" if backend == "cpu" else "auto"  # our C kernels run on the CPU beside a GPU too
    config = EngineConfig(model=tiny_dir, device=device, dtype="float32", max_num_seqs=12, block_size=4,
                          num_kv_blocks=400, attention_backend=backend)  # fmt: skip
    core = EngineCore(config)
    runner = core.runner
    assert runner.attn_backend.name == backend
    assert all(layer.attn_backend is runner.attn_backend for layer in runner.model.attention_layers())
    width = -(-core.max_model_len // config.block_size)
    graphs = DecodeGraphs(runner.model, config.max_num_seqs, width, runner.scratch_slot, config.block_size,
                          runner.device, runner.attn_backend.index_dtype, capture=False)  # fmt: skip
    graphs.capture_all()
    assert sorted(graphs.graphs) == batch_buckets(12) and graphs.tables.shape == (12, width)
    runner.decode_graphs = graphs
    replay = graphs.run
    checked: list[int] = []
    mismatches: list[bool] = []
    buckets: set[int] = set()

    def run_and_compare(input_ids, positions, meta):
        hidden = replay(input_ids, positions, meta)[: meta.num_decodes].clone()
        batch = graphs.bucket(meta.num_decodes)
        buckets.add(batch)
        # Padding rows are length 0, whatever earlier steps left there (the engine would catch an assert).
        mismatches.append(bool(graphs.seq_lens[meta.num_decodes : batch].any()))
        eager = runner.model(input_ids, positions, meta)[: meta.num_decodes]
        mismatches.append(not torch.allclose(hidden, eager, atol=1e-5, rtol=1e-5))  # the engine catches asserts
        checked.append(meta.num_decodes)
        return hidden

    graphs.run = run_and_compare
    # Staggered arrivals of different lengths: decode batches take many sizes, tables many widths.
    requests = [
        EngineRequest(f"r{i}", [(11 * i + 5 * j) % 290 + 4 for j in range(3 + 13 * i)],
                      SamplingParams(max_tokens=20 + 9 * (i % 4), temperature=0, ignore_eos=True))
        for i in range(12)
    ]  # fmt: skip
    step = 0
    while requests or core.has_work:
        if requests and step % 4 == 0:
            core.add_request(requests.pop(0))
        core.step()
        core.kv.check_integrity(list(core.scheduler.requests.values()))
        step += 1
    assert len(checked) > 20 and len(set(checked)) >= 6
    assert not any(mismatches)
    assert len(buckets) >= 4 and any(b > n for b, n in zip(map(graphs.bucket, checked), checked, strict=True))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_prompt_chunks_as_decode_rows_match_the_prefill_path(tiny_dir, backend, monkeypatch) -> None:
    """A step that fits the largest graph runs its prompt chunks as decode rows (each attends to the keys up to its
    own position). Against an engine without graphs, whose prompts take the prefill path: the same tokens, token
    and prompt logprobs over chunked prompts, prefix-cache hits and the decodes beside them; steps larger than
    the graph still run eagerly, and so do prompt chunks that would read too much K/V as decode rows."""
    from engine_core import cuda_graphs
    from engine_core.cuda_graphs import graph_rows
    from tests.engine_helpers import run_engine

    device = "cpu" if backend == "cpu" else "auto"
    config = EngineConfig(model=tiny_dir, device=device, dtype="float32", max_num_seqs=4, block_size=4,
                          num_kv_blocks=400, attention_backend=backend, max_num_batched_tokens=40,
                          mixed_step_graphs=True)  # fmt: skip
    assert graph_rows(config) == 40 and graph_rows(EngineConfig(max_num_batched_tokens=8192)) == 128  # off: default
    assert graph_rows(EngineConfig(max_num_batched_tokens=8192, mixed_step_graphs=True)) == 1024
    shared = [(7 * j) % 290 + 4 for j in range(16)]  # four blocks: later prompts hit the prefix cache
    requests = [
        EngineRequest(f"r{i}", shared + [(11 * i + 5 * j) % 290 + 4 for j in range(2 + 9 * i)],
                      SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2,
                                     prompt_logprobs=1 if i % 2 else None))
        for i in range(8)
    ]  # fmt: skip

    def run(graphed: bool) -> tuple[dict, list[int]]:
        core = EngineCore(config)
        rows: list[int] = []
        if graphed:
            runner = core.runner
            width = -(-core.max_model_len // config.block_size)
            graphs = DecodeGraphs(runner.model, 24, width, runner.scratch_slot, config.block_size, runner.device,
                                  runner.attn_backend.index_dtype, capture=False)  # fmt: skip
            graphs.capture_all()
            runner.decode_graphs = graphs
            replay = graphs.run

            def counted(input_ids, positions, meta):
                rows.append(meta.num_decodes)
                return replay(input_ids, positions, meta)

            graphs.run = counted
        return run_engine(core, requests, stagger=2), rows

    graphed, rows = run(True)
    plain, _ = run(False)
    assert max(rows) > 4  # steps with more rows than requests: prompt tokens ran as decode rows
    monkeypatch.setattr(cuda_graphs, "PROMPT_ROWS_KV_BYTES", 0)
    guarded, guarded_rows = run(True)
    assert max(guarded_rows) <= 4  # only decode-only steps replayed
    for rid, outs in [*plain.items(), *((f"{rid} (guarded)", outs) for rid, outs in guarded.items())]:
        mine = graphed[rid.split()[0]]
        assert [o.new_token_ids for o in mine] == [o.new_token_ids for o in outs], rid
        for a, b in zip(mine, outs, strict=True):
            for x, y in ((a.new_logprobs, b.new_logprobs), (a.prompt_logprobs, b.prompt_logprobs)):
                assert (x is None) == (y is None), rid
                if x is not None and y is not None:
                    assert x.top_ids == y.top_ids, rid
                    assert torch.allclose(torch.tensor(x.token_logprobs), torch.tensor(y.token_logprobs), atol=1e-4)
    assert any(o.prompt_logprobs is not None for outs in graphed.values() for o in outs)
