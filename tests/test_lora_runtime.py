"""LoRA adapters that come and go while the engine runs: loaded when first named (a runtime load, a request resumed on
a restarted engine), unloaded only once no request uses them, and never confused with other weights of the same
name in the prefix cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from common.lora import ADAPTER_WEIGHTS
from common.messages import FinishReason, LoraRef
from engine_core.core import EngineCore
from tests.engine_helpers import fp32_config, run_engine, tokens_of
from tests.lora_helpers import lora_request, refs, tiny_model_and_adapters, tiny_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_and_adapters(tmp_path_factory.mktemp("lora-runtime"))


def test_adapters_load_on_first_use_and_fail_alone(tiny, tmp_path):
    """An adapter the engine has not loaded (a runtime load, or a request resumed on a restarted engine) loads when a
    request first names it, and answers as one loaded at start; one it cannot load fails its own request only."""
    model, adapters = tiny
    config = fp32_config(model=model, enable_lora=True, lora_modules=[f"every={adapters['every']}"])
    prompt = tiny_prompts()[3]
    at_start = run_engine(EngineCore(config), [lora_request("start", prompt, refs(config)["every"])])
    core = EngineCore(fp32_config(model=model, enable_lora=True))  # none at start
    later = LoraRef(7, "every", adapters["every"])
    (tmp_path / "empty").mkdir()
    results = run_engine(core, [lora_request("gone", prompt, LoraRef(8, "gone", str(tmp_path / "missing"))),
                                lora_request("later", prompt, later),
                                lora_request("empty", prompt, LoraRef(9, "empty", str(tmp_path / "empty")))])
    assert tokens_of(results, ["later"]) == tokens_of(at_start, ["start"])
    for rid, why in (("gone", "no such directory"), ("empty", "cannot read adapter_config.json")):
        assert results[rid][-1].finish_reason == FinishReason.ERROR and why in (results[rid][-1].error or "")
    assert set(core.runner.lora.names) == {7}
    off = run_engine(EngineCore(fp32_config(model=model)), [lora_request("off", prompt, later)])
    assert "not enabled" in (off["off"][-1].error or "")


def test_unloaded_adapter_stays_until_its_last_request_ends(tiny):
    """Unloading frees nothing a running request still uses: it finishes on the adapter, as it would have, and the
    weights go after it. A request that arrives with the adapter after the unload (sent before it) is served, and
    its weights go after that one too."""
    model, adapters = tiny
    config = fp32_config(model=model, enable_lora=True, lora_modules=[f"every={adapters['every']}"])
    every = refs(config)["every"]
    prompt = tiny_prompts()[2]
    reference = run_engine(EngineCore(config), [lora_request("ref", prompt, every, 24)])
    core = EngineCore(config)
    core.add_request(lora_request("running", prompt, every, 24))
    outputs = [out for _ in range(4) for out in core.step()]
    core.unload_lora(every)
    assert every.id in core.runner.lora.names  # still in use
    while core.has_work:
        outputs += core.step()
    assert [t for o in outputs for t in o.new_token_ids] == tokens_of(reference, ["ref"])[0]
    lora = core.runner.lora
    assert not lora.names and all(u is None for w in lora.layers.values() for u in w.by_index)
    late = run_engine(core, [lora_request("late", prompt, every, 24)])
    assert tokens_of(late, ["late"]) == tokens_of(reference, ["ref"]) and not lora.names


def test_reloaded_adapter_shares_no_cached_blocks_with_its_old_weights(tiny, tmp_path):
    """A name loaded again in place (new weights in the same directory) is a new id: the prefix cache, keyed by id,
    cannot hand it the K/V the old weights computed, and it answers as its new weights do."""
    model, adapters = tiny
    path = shutil.copytree(adapters["qv"], tmp_path / "qv")
    core = EngineCore(fp32_config(model=model, enable_lora=True))
    prompt = tiny_prompts()[-1]  # four full blocks
    old = run_engine(core, [lora_request("old", prompt, LoraRef(1, "qv", str(path)))])
    shutil.copy(Path(adapters["every"]) / ADAPTER_WEIGHTS, path)  # the directory now holds other weights
    shutil.copy(Path(adapters["every"]) / "adapter_config.json", path)
    core.unload_lora(LoraRef(1, "qv", str(path)))
    new = run_engine(core, [lora_request("new", prompt, LoraRef(2, "qv", str(path)))])
    assert core.runner.lora.index == {2: 0}  # the old weights' place, taken again
    assert old["old"][0].num_cached_tokens == new["new"][0].num_cached_tokens == 0
    every = run_engine(EngineCore(fp32_config(model=model, enable_lora=True)),
                       [lora_request("every", prompt, LoraRef(1, "every", adapters["every"]))])  # fmt: skip
    assert tokens_of(new, ["new"]) == tokens_of(every, ["every"]) != tokens_of(old, ["old"])
