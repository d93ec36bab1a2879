"""common/pooling.py: which runner a model directory gets, and the pooling its sentence-transformers files ask for."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from common.model_source import ModelSourceError
from common.pooling import Pooling, pick_runner, read_pooling

ST = "sentence_transformers.models."


def model_dir(tmp_path: Path, modules: list[str] | None = None, pooling: dict | None = None, **config) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, **config}))
    if modules is not None:
        entries = [{"idx": i, "name": str(i), "path": f"{i}_{kind}" if i else "", "type": ST + kind}
                   for i, kind in enumerate(modules)]  # fmt: skip
        (tmp_path / "modules.json").write_text(json.dumps(entries))
        if "Pooling" in modules:
            folder = tmp_path / f"{modules.index('Pooling')}_Pooling"
            folder.mkdir()
            modes = {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False, **(pooling or {})}
            (folder / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    return tmp_path


def test_a_decoder_without_sentence_transformers_files_pools_its_last_token_normalized(tmp_path: Path) -> None:
    assert read_pooling(model_dir(tmp_path)) == Pooling(64, normalize=True, dimensions=None)


@pytest.mark.parametrize(("modules", "normalize"), [(["Transformer", "Pooling", "Normalize"], True),
                                                    (["Transformer", "Pooling"], False)])  # fmt: skip
def test_sentence_transformers_modules_say_whether_to_normalize(tmp_path: Path, modules, normalize: bool) -> None:
    assert read_pooling(model_dir(tmp_path, modules)).normalize is normalize


@pytest.mark.parametrize(("config", "dimensions"), [({}, None), ({"is_matryoshka": True}, ()),
                                                    ({"matryoshka_dimensions": [32, 64]}, (32, 64))])  # fmt: skip
def test_matryoshka_lengths_come_from_the_config(tmp_path: Path, config: dict, dimensions) -> None:
    assert read_pooling(model_dir(tmp_path, **config)).dimensions == dimensions


@pytest.mark.parametrize(("modules", "pooling", "words"), [
    (["Transformer", "Pooling", "Normalize"], {"pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": True},
     "pooling mean_tokens is not supported"),
    (["Transformer", "Pooling"], {"pooling_mode_cls_token": True}, "pooling cls_token + lasttoken is not supported"),
    (["Transformer", "Pooling", "Dense", "Normalize"], None, "the 'Dense' module is not supported"),
])  # fmt: skip
def test_a_pooling_we_cannot_compute_stops_the_server_at_start(tmp_path: Path, modules, pooling, words) -> None:
    path = model_dir(tmp_path, modules, pooling)
    with pytest.raises(ModelSourceError, match=re.escape(words)):
        pick_runner("auto", path, "Qwen3ForCausalLM")  # a sentence-transformers directory: pooling


def test_auto_picks_pooling_for_headless_checkpoints_and_sentence_transformers_directories(tmp_path: Path) -> None:
    (tmp_path / "lm").mkdir()
    plain = model_dir(tmp_path / "lm")
    assert pick_runner("auto", plain, "Qwen3ForCausalLM") == "generate"
    assert pick_runner("auto", plain, "Qwen3Model") == "pooling"
    assert pick_runner("pooling", plain, "LlamaForCausalLM") == "pooling"  # any decoder, asked for
    (tmp_path / "st").mkdir()
    st = model_dir(tmp_path / "st", ["Transformer", "Pooling", "Normalize"])
    assert pick_runner("auto", st, "Qwen3ForCausalLM") == "pooling"
    assert pick_runner("generate", st, "Qwen3ForCausalLM") == "generate"  # its LM head, asked for
    with pytest.raises(ModelSourceError, match="no LM head"):
        pick_runner("generate", plain, "MistralModel")
