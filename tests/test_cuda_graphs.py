"""The decode-graph runner's buffers and buckets, run eagerly on CPU (capture=False): the same tokens as the
plain eager path, while batches shrink and grow across buckets and block tables widen past several buckets.
The capture itself needs a GPU and is not exercised here."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.config import EngineConfig
from common.messages import EngineRequest, SamplingParams
from engine_core.core import EngineCore
from engine_core.cuda_graphs import DecodeGraphs, batch_buckets, width_bucket


def test_buckets() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    assert [width_bucket(w, 20) for w in (1, 2, 3, 4, 5, 9, 17, 20)] == [1, 2, 4, 4, 8, 16, 20, 20]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=3, tie_word_embeddings=True, initializer_range=0.3)  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-graphs")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def test_graph_buffers_match_the_eager_forward(tiny_dir) -> None:
    """Every decode step goes through the graph buffers and, right after, through the plain forward on the
    same inputs (rewriting the same KV): the hidden states of the real rows must agree."""
    config = EngineConfig(model=tiny_dir, dtype="float32", max_num_seqs=12, block_size=4, num_kv_blocks=400)
    core = EngineCore(config)
    runner = core.runner
    graphs = DecodeGraphs(runner.model, config.max_num_seqs, -(-core.max_model_len // config.block_size),
                          runner.scratch_slot, config.block_size, runner.device, capture=False)  # fmt: skip
    runner.decode_graphs = graphs
    replay = graphs.run
    checked: list[int] = []
    mismatches: list[bool] = []

    def run_and_compare(input_ids, positions, meta):
        hidden = replay(input_ids, positions, meta)[: meta.num_decodes].clone()
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
    used_batches, used_widths = {b for b, _ in graphs.graphs}, {w for _, w in graphs.graphs}
    assert len(used_batches) >= 4 and len(used_widths) >= 4, graphs.graphs.keys()
    assert used_batches <= set(batch_buckets(12))
