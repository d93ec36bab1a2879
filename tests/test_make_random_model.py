"""bench/make_random_model.py: the named shapes, and a written smollm2-135m directory that the engine loads and
generates from."""

from __future__ import annotations

import json
import math
import shutil

from transformers import AutoTokenizer

from bench import make_random_model
from bench.make_random_model import model_config, tensor_shapes, write_model
from common.messages import EngineRequest, SamplingParams
from common.model_source import resolve_model
from engine_core.core import EngineCore
from tests.engine_helpers import fp32_config, run_engine, tokens_of


def params_of(name: str) -> int:
    return sum(math.prod(shape) for _, shape in tensor_shapes(model_config(name)))


def test_named_shapes() -> None:
    assert 6.8e9 < params_of("llama-7b") < 6.9e9  # Llama-2-7B (6.74e9) with 49152 tokens instead of 32000
    assert 1.0e9 < params_of("llama-1b") < 1.1e9  # tied embeddings, as Llama-3.2-1B
    assert 1.3e8 < params_of("smollm2-135m") < 1.4e8
    assert 1.3e8 < params_of("gemma3-270m") < 1.35e8  # gemma-3-270m's 100M outside the embedding, 49152 tokens
    assert 2.9e9 < params_of("smollm3-3b") < 2.95e9  # SmolLM3-3B's 3.08e9 with 49152 tokens instead of 128256
    # Qwen3-Embedding-0.6B's 5.96e8 with 49152 tokens instead of 151669: tied, each head's q and k normed
    assert 4.9e8 < params_of("qwen3-embedding-0.6b") < 4.92e8
    names = [name for name, _ in tensor_shapes(model_config("qwen3-embedding-0.6b"))]
    assert "model.layers.0.self_attn.q_norm.weight" in names and "lm_head.weight" not in names
    # Qwen3-30B-A3B's layer (623M parameters, 48 of them and 151936 tokens: its 30.5e9), 4 of them, 49152 tokens
    assert 2.69e9 < params_of("qwen3-moe-a3b-4l") < 2.7e9
    assert 6.91e9 < params_of("olmoe-1b-7b") < 6.92e9  # OLMoE-1B-7B's 6.92e9 with 49152 tokens, not 50304
    assert 2.53e9 < params_of("granite-3-2b") < 2.54e9  # Granite-3.3-2B's 2.53e9 (49155 tokens)
    assert 1.27e9 < params_of("olmo2-1b") < 1.28e9  # OLMo-2-0425-1B's 1.48e9 with 49152 tokens, not 100352


def test_a_written_olmo2_loads_and_generates(tmp_path, monkeypatch) -> None:
    """OLMo 2's names (no input norm; q and k norms over all heads; a norm after the MLP), on a small copy."""
    small = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
             "intermediate_size": 96, "num_hidden_layers": 2}  # fmt: skip
    monkeypatch.setitem(make_random_model.SHAPES, "olmo2-small", {**make_random_model.SHAPES["olmo2-1b"], **small})
    core = EngineCore(fp32_config(model=str(write_model("olmo2-small", tmp_path / "o")), max_model_len=256))
    assert type(core.runner.model).__name__ == "Olmo2ForCausalLM"
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (tokens,) = tokens_of(run_engine(core, [EngineRequest("o", list(range(5, 40)), params)]), ["o"])
    assert len(tokens) == 4 and all(0 <= t < 49152 for t in tokens)


def test_a_written_mixture_of_experts_loads_and_generates(tmp_path, monkeypatch) -> None:
    """The MoE layout's names (router, experts) as the loader reads them, on a small copy of the named shape."""
    small = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "moe_intermediate_size": 32, "num_experts": 6, "num_experts_per_tok": 2}  # fmt: skip
    shape = {**make_random_model.SHAPES["qwen3-moe-a3b-4l"], **small}
    monkeypatch.setitem(make_random_model.SHAPES, "moe-small", shape)
    core = EngineCore(fp32_config(model=str(write_model("moe-small", tmp_path / "m")), max_model_len=256))
    assert type(core.runner.model).__name__ == "MoeForCausalLM"
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (tokens,) = tokens_of(run_engine(core, [EngineRequest("m", list(range(5, 40)), params)]), ["m"])
    assert len(tokens) == 4 and all(0 <= t < 49152 for t in tokens)


def test_a_written_gemma3_loads_and_generates(tmp_path) -> None:
    core = EngineCore(fp32_config(model=str(write_model("gemma3-270m", tmp_path / "g")), max_model_len=1024))
    assert type(core.runner.model).__name__ == "Gemma3ForCausalLM"
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (tokens,) = tokens_of(run_engine(core, [EngineRequest("g", list(range(5, 605)), params)]), ["g"])
    assert len(tokens) == 3 and all(0 <= t < 49152 for t in tokens)  # a 600-token prompt: past the 512-key window


def test_written_model_loads_and_generates(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(make_random_model, "SHARD_BYTES", 64 * 2**20)  # several shards, as a 7B model has
    path = write_model("smollm2-135m", tmp_path / "random")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2 * params_of("smollm2-135m")  # bf16
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) == 5 and shards == sorted(set(index["weight_map"].values())), shards
    assert AutoTokenizer.from_pretrained(path)("Hello")["input_ids"]
    core = EngineCore(fp32_config(model=str(path), max_model_len=256))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    results = run_engine(core, [EngineRequest("a", [1, 504, 3000, 42], params)])
    (tokens,) = tokens_of(results, ["a"])
    assert len(tokens) == 5 and all(0 <= t < 49152 for t in tokens)


def test_base_dir_stands_in_for_the_default_model(tmp_path) -> None:
    """--base: config.json and tokenizer files copied out of the default model are all a GPU machine needs."""
    default = resolve_model(None).path
    base = tmp_path / "base"
    base.mkdir()
    for f in ("config.json", *make_random_model.TOKENIZER_FILES):
        if (default / f).is_file():
            shutil.copy(default / f, base / f)
    (base / "config.json").write_text(json.dumps({**json.loads((default / "config.json").read_text()),
                                                   "rms_norm_eps": 1e-3}))  # fmt: skip
    assert model_config("llama-1b", base)["rms_norm_eps"] == 1e-3  # read from the base, not the default model
    path = write_model("smollm2-135m", tmp_path / "random", base_dir=base)
    assert json.loads((path / "config.json").read_text())["rms_norm_eps"] == 1e-3
    assert (path / "tokenizer.json").read_bytes() == (default / "tokenizer.json").read_bytes()
    assert AutoTokenizer.from_pretrained(path)("Hello")["input_ids"]
