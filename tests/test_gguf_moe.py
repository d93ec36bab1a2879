"""A Qwen3-MoE GGUF as llama.cpp writes one (Qwen3-30B-A3B is among the most shared GGUFs): the experts stacked per
layer (`ffn_{gate,up,down}_exps`), the router (`ffn_gate_inp`), the expert size in its own field. transformers' GGUF
loader drops that field and leaves the top-k weights unnormalized (its config's default), where llama.cpp and the
model normalize them; the conversion reads both back (common/gguf_fields.py), and the server gives the model's own
greedy tokens."""

from __future__ import annotations

from pathlib import Path

import gguf
import torch
import transformers

from common import gguf_convert
from common.model_source import resolve_model
from tests.engine_helpers import assert_serves_hf_greedy
from tests.gguf_helpers import VOCAB, random_model, write_gguf

EXPERTS, EXPERT_SIZE, HEAD_DIM = 4, 32, 64


def test_a_qwen3_moe_gguf_serves_the_tokens_of_the_model_it_came_from(tmp_path: Path, monkeypatch) -> None:
    """Converted a layer at a time (each layer's experts are fused from three of its tensors), into one shard each."""
    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=EXPERT_SIZE, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=HEAD_DIM, num_experts=EXPERTS,
                                         num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                                         architectures=["Qwen3MoeForCausalLM"])  # fmt: skip
    model = random_model(transformers.Qwen3MoeForCausalLM, config)
    tensors, experts = {}, {}
    for name, tensor in model.state_dict().items():  # transformers holds each layer's experts stacked, as GGUF
        block = f"blk.{name.split('.')[2]}." if ".mlp." in name else ""
        if name.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 * size, hidden]: gate rows, then up rows
            experts[block + "ffn_gate_exps.weight"], experts[block + "ffn_up_exps.weight"] = tensor.chunk(2, dim=1)
        elif name.endswith("mlp.experts.down_proj"):
            experts[block + "ffn_down_exps.weight"] = tensor
        elif name.endswith("mlp.gate.weight"):
            experts[block + "ffn_gate_inp.weight"] = tensor
        else:
            tensors[name] = tensor
    assert len(experts) == 4 * config.num_hidden_layers

    def fields(writer: gguf.GGUFWriter) -> None:
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(EXPERT_SIZE)

    path = tmp_path / "qwen3-moe-tiny.gguf"
    write_gguf(path, gguf.MODEL_ARCH.QWEN3MOE, config, fields, tensors, experts)
    monkeypatch.setattr(gguf_convert, "GROUP_BYTES", 1)  # every layer a group of its own
    resolved = resolve_model(str(path), cache_dir=tmp_path / "cache")
    shards = sorted(p.name for p in resolved.path.glob("*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]  # embeddings and head, 2 layers
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(resolved.path).state_dict()  # through the index
    assert reloaded.keys() == model.state_dict().keys()
    assert all(torch.equal(reloaded[name], tensor) for name, tensor in model.state_dict().items())
    converted = transformers.AutoConfig.from_pretrained(resolved.path)
    assert (converted.moe_intermediate_size, converted.norm_topk_prob) == (EXPERT_SIZE, True)
    assert_serves_hf_greedy(resolved.path, model, [[5, 900, 1200, 33] * 5, [300 + i for i in range(30)]])
