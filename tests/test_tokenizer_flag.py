"""--tokenizer (vLLM's): a model directory without a tokenizer served with another directory's, in the engine (the
grammars' vocabulary) and in the text stack (prompts, chat template, detokenizing)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

import launch
from bench.make_random_model import TOKENIZER_FILES, write_model
from common.messages import EngineRequest, SamplingParams, StructuredOutput
from common.model_source import ModelSourceError, resolve_model
from engine_core.core import EngineCore
from frontend.offline.llm import LLM
from frontend.text.tokenizer import Tokenizer, TokenizerError
from tests.conftest import Server
from tests.engine_helpers import GPU_TEST_KV, fp32_config, greedy_request, run_engine, save_tiny_llama, tokens_of


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny random model with the default model's tokenizer, and a copy of it without any tokenizer file."""
    whole = write_model("tiny", tmp_path_factory.mktemp("whole") / "model")
    bare = tmp_path_factory.mktemp("bare") / "model"
    shutil.copytree(whole, bare)
    for name in TOKENIZER_FILES:
        if name != "generation_config.json":  # the model's own (its EOS), not the tokenizer's
            (bare / name).unlink(missing_ok=True)
    return whole, bare


def test_a_model_without_a_tokenizer_is_served_with_the_one_given(models) -> None:
    whole, bare = models
    assert resolve_model(str(bare), tokenizer=str(whole)).tokenizer == whole
    assert resolve_model(str(bare)).tokenizer == bare  # without the flag: the model's own directory
    # The engine alone: the same greedy tokens, and a JSON grammar compiled over the given tokenizer's vocabulary
    prompt = [1, 504, 3575, 282, 4649, 314]
    json_only = SamplingParams(max_tokens=12, temperature=0.0, structured=StructuredOutput("json_object"))
    outputs = []
    for model, tokenizer in ((whole, None), (bare, str(whole))):
        core = EngineCore(fp32_config(model=str(model), tokenizer=tokenizer, max_model_len=256))
        requests = [greedy_request("plain", prompt, 8), EngineRequest("json", prompt, json_only)]
        outputs.append(tokens_of(run_engine(core, requests), ["plain", "json"]))
    assert outputs[0] == outputs[1] and len(outputs[0][0]) == 8
    assert Tokenizer(whole).decode(outputs[1][1]).lstrip().startswith("{"), outputs  # the grammar held
    # The offline LLM (the server's text stack): prompts encoded and answers decoded by the given tokenizer
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        LLM(str(bare), dtype="float32", **GPU_TEST_KV)
    with LLM(str(bare), tokenizer=str(whole), dtype="float32", max_model_len=256, **GPU_TEST_KV) as llm:
        (answer,) = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                          min_tokens=8), use_tqdm=False)  # fmt: skip
        assert answer.token_ids == outputs[0][0] and answer.text == llm.tokenizer.decode(answer.token_ids)
        assert llm.chat_prompt([{"role": "user", "content": "hi"}])[:3] == [1, 9690, 198]  # the chat template's


def test_a_tokenizer_that_is_not_one_stops_the_server_at_start(tmp_path: Path, capsys) -> None:
    with pytest.raises(ModelSourceError, match="--tokenizer"):
        resolve_model(None, tokenizer=str(tmp_path))
    assert launch.main(["--port", "1", "--tokenizer", str(tmp_path)]) == 2
    assert "not a directory with a tokenizer.json" in capsys.readouterr().err


def test_a_tokenizer_larger_than_the_model_is_warned_of_and_its_extra_ids_refused(tmp_path: Path) -> None:
    """A 300-token model served with the default model's 49152-token tokenizer: a warning at start; a prompt whose
    text encodes to ids past the model's vocabulary is a 400, not an index error in the engine."""
    model = save_tiny_llama(tmp_path / "tiny", max_positions=512, init=0.02)
    server = Server(tmp_path, "--model", model, "--tokenizer", str(resolve_model(None).path), "--max-model-len", "512",
                    "--log-level", "info")  # fmt: skip
    try:
        server.wait_healthy()
        body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": True}
        refused = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert refused.status_code == 400 and "outside the vocabulary [0, 300)" in refused.json()["error"]["message"]
        ids = httpx.post(server.url + "/v1/completions", json={**body, "prompt": [5, 17, 299]}, timeout=60)
        assert ids.status_code == 200 and ids.json()["usage"]["completion_tokens"] == 4
        server.assert_clean_exit()
        assert "has 49152 tokens, the model 300: prompts holding the others are refused" in server.log.read_text()
    finally:
        server.stop()
