"""Random-weight Llama-family (and Granite, OLMo 2, Gemma 3, mixture-of-experts) models for benchmarks: an HF
directory (config.json, sharded bf16 safetensors, the default model's tokenizer and chat template) of a named
shape. Speed depends on the shape, not on the values.

python -m bench.make_random_model NAME OUT_DIR [--seed 0] [--base DIR]
NAME: smollm2-135m | llama-1b | llama-7b | smollm3-3b | gemma3-270m | qwen3-embedding-0.6b | qwen3-reranker-0.6b |
      qwen3-moe-a3b-4l | qwen3-moe-a3b-12l | olmoe-1b-7b | granite-3-2b | olmo2-1b | tiny

--base: a directory holding the default model's config.json and tokenizer files (TOKENIZER_FILES), to use instead
of the default model itself: 4 MB to bring to a GPU machine rather than its 93 MB GGUF package.

Weights are drawn tensor by tensor in bf16 (std 0.02, norms 1) and written a shard at a time, so a 7B model
never exists in memory as a whole, let alone in fp32.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.model_source import resolve_model

# Overrides of the default model's (SmolLM2-135M) config.json.
SHAPES: dict[str, dict] = {
    "smollm2-135m": {},
    # For tests that need the default tokenizer and chat template but not the model's words: steps cost nothing.
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "head_dim": 16},
    "llama-1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "intermediate_size": 8192, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True},
    "llama-7b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                 "intermediate_size": 11008, "head_dim": 128, "vocab_size": 49152, "tie_word_embeddings": False,
                 "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                 "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
    # SmolLM3-3B's layers (every fourth without rotary embeddings) with the default vocabulary.
    "smollm3-3b": {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_size": 2048,
                   "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
                   "intermediate_size": 11008, "vocab_size": 49152, "tie_word_embeddings": True,
                   "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "no_rope_layer_interval": 4,
                   "rope_parameters": {"rope_theta": 5000000.0, "rope_type": "default"}},
    # Gemma 3 270M's layers (five sliding-window layers to one global, heads of 256) with the default vocabulary.
    "gemma3-270m": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640,
                    "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                    "intermediate_size": 2048, "vocab_size": 49152, "tie_word_embeddings": True,
                    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "sliding_window": 512,
                    "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
                    "layer_types": ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)],
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}},
    # Qwen3-Embedding-0.6B (tied embeddings, so no LM head of its own) with the default vocabulary, and its
    # sentence-transformers files (SENTENCE_TRANSFORMERS), which make the server embed rather than generate.
    "qwen3-embedding-0.6b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
                             "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                             "head_dim": 128, "intermediate_size": 3072, "vocab_size": 49152,
                             "tie_word_embeddings": True, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                             "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}},
    # Qwen3-30B-A3B's layers (128 experts of 768 columns, 8 a token), 4 of its 48, with the default vocabulary: 5.4 GB.
    "qwen3-moe-a3b-4l": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                         "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                         "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                         "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                         "mlp_only_layers": [], "vocab_size": 49152, "tie_word_embeddings": False,
                         "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                         "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}},
}  # fmt: skip
# OLMoE-1B-7B's (64 experts of 1024 columns, 8 a token; q and k normed over all heads) with the default vocabulary
SHAPES["olmoe-1b-7b"] = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 2048,
                         "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
                         "head_dim": 128, "intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8,
                         "norm_topk_prob": False, "clip_qkv": None, "vocab_size": 49152,
                         "tie_word_embeddings": False, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                         "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}  # fmt: skip
SHAPES["qwen3-moe-a3b-12l"] = {**SHAPES["qwen3-moe-a3b-4l"], "num_hidden_layers": 12}  # 15 GB, for a GPU
# Granite-3.3-2B's layers and multipliers, and OLMo-2-0425-1B's (norms after the blocks), with the default vocabulary
SHAPES["granite-3-2b"] = {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "hidden_size": 2048,
                          "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                          "intermediate_size": 8192, "vocab_size": 49152, "tie_word_embeddings": True,
                          "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "embedding_multiplier": 12.0,
                          "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 8.0,
                          "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"}}  # fmt: skip
SHAPES["olmo2-1b"] = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_size": 2048,
                      "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 128,
                      "intermediate_size": 8192, "vocab_size": 49152, "tie_word_embeddings": False,
                      "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
                      "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}  # fmt: skip
# Qwen3-Reranker-0.6B: the same decoder, saved as a causal LM (served with --hf-overrides, bench/rerank.py)
SHAPES["qwen3-reranker-0.6b"] = SHAPES["qwen3-embedding-0.6b"]
SENTENCE_TRANSFORMERS = {"qwen3-embedding-0.6b"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")  # fmt: skip
SHARD_BYTES = 2 * 2**30


def model_config(name: str, base_dir: Path | None = None) -> dict:
    base = json.loads(((base_dir or resolve_model(None).path) / "config.json").read_text())
    config = {**base, **SHAPES[name], "dtype": "bfloat16", "_model_name_or_path": f"random-{name}"}
    config.pop("torch_dtype", None)
    return config


def tensor_shapes(config: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """HF Llama (or Granite, Gemma 3, Qwen3, Qwen3-MoE: every layer sparse, OLMo 2) checkpoint names and shapes."""
    gemma, olmo2 = config.get("model_type") == "gemma3_text", config.get("model_type") == "olmo2"
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (vocab, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if not olmo2:  # OLMo 2 norms after the blocks only
            yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "post_attention_layernorm.weight", (h,)
        if gemma or config.get("model_type") in ("qwen3", "qwen3_moe"):
            yield from ((p + name, (d,)) for name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"))
        if config.get("model_type") in ("olmoe", "olmo2"):  # over all heads
            yield from ((p + "self_attn.q_norm.weight", (q,)), (p + "self_attn.k_norm.weight", (kv,)))
        if gemma:
            yield p + "pre_feedforward_layernorm.weight", (h,)
        if gemma or olmo2:
            yield p + "post_feedforward_layernorm.weight", (h,)
        mlps = [("mlp.", inter)]
        if config.get("num_experts"):  # the router and its experts
            yield p + "mlp.gate.weight", (config["num_experts"], h)
            size = config.get("moe_intermediate_size", inter)  # OLMoE's experts: intermediate_size
            mlps = [(f"mlp.experts.{e}.", size) for e in range(config["num_experts"])]
        for mlp, size in mlps:
            yield p + mlp + "gate_proj.weight", (size, h)
            yield p + mlp + "up_proj.weight", (size, h)
            yield p + mlp + "down_proj.weight", (h, size)
    yield "model.norm.weight", (h,)
    if not config.get("tie_word_embeddings"):
        yield "lm_head.weight", (vocab, h)


def random_tensor(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:  # RMSNorm scales (Gemma's: 1 + this)
        return torch.ones(shape, dtype=torch.bfloat16)
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)


def write_model(name: str, out: Path, seed: int = 0, base_dir: Path | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    source = base_dir or resolve_model(None).path  # resolved once: config and tokenizer come from the same place
    config = model_config(name, source)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in TOKENIZER_FILES:
        if (source / f).is_file():
            shutil.copy(source / f, out / f)
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    weight_map: dict[str, int] = {}
    size = total = 0
    for key, shape in tensor_shapes(config):
        t = random_tensor(shape, gen)
        if size and size + t.nbytes > SHARD_BYTES:
            _flush(out, shards, len(shards) - 1)
            shards.append({})
            size = 0
        shards[-1][key] = t
        weight_map[key] = len(shards) - 1
        size += t.nbytes
        total += t.nbytes
    count = len(shards)
    _flush(out, shards, count - 1)
    files = {i: f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)}
    for i in range(count):
        (out / f"part-{i}.safetensors").rename(out / files[i])
    index = {"metadata": {"total_size": total}, "weight_map": {k: files[i] for k, i in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if name in SENTENCE_TRANSFORMERS:
        write_sentence_transformers(out, config["hidden_size"])
    return out


def write_sentence_transformers(out: Path, hidden_size: int) -> None:
    """The files of a sentence-transformers embedding model pooled at the last token and normalized, as
    Qwen3-Embedding's: modules.json (Transformer, Pooling, Normalize) and the Pooling's config."""
    st = "sentence_transformers.models."
    modules = [{"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"}]  # fmt: skip
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": hidden_size, "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
               "pooling_mode_lasttoken": True, "include_prompt": True}  # fmt: skip
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))


def _flush(out: Path, shards: list[dict[str, torch.Tensor]], i: int) -> None:
    save_file(shards[i], str(out / f"part-{i}.safetensors"), metadata={"format": "pt"})
    shards[i] = {}  # the shard's tensors are freed once written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(SHAPES))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base", type=Path, default=None, help="config.json + tokenizer files of the default model")
    args = parser.parse_args()
    if any(args.out_dir.glob("*.safetensors")):
        parser.error(f"{args.out_dir} already holds weights")
    path = write_model(args.name, args.out_dir, args.seed, args.base)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"wrote {args.name} to {path} ({size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
