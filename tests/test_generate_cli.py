"""The generate CLI and the offline LLM entry on the default model, against transformers generate."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.make_random_lora import write_adapter
from common.messages import SamplingParams
from common.model_source import resolve_model
from frontend.offline.llm import LLM
from tests.engine_helpers import GPU_TEST_KV
from tests.lora_helpers import merged

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_cli_answers_paris() -> None:
    kv = [f"--{k.replace('_', '-')}={v}" for k, v in GPU_TEST_KV.items()]
    proc = subprocess.run([sys.executable, "-m", "frontend.offline.generate", "--prompt",
                           "What is the capital of France?", "--dtype", "float32", "--max-tokens", "32", *kv],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "/no/such/model"], ""),
    (["--lora", "sql"], "--lora 'sql' is not an adapter of --lora-modules (none)"),
    (["--lora-modules", "sql=/no/such/adapter"], "--lora-modules needs --enable-lora"),
])  # fmt: skip
def test_cli_reports_a_bad_model_or_adapter_in_one_line(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "frontend.offline.generate", *args], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("error:") and "Traceback" not in proc.stderr
    assert message in proc.stderr


def test_llm_matches_hf_greedy_and_keeps_order(tmp_path) -> None:
    """Also through a LoRA adapter: as transformers with it merged."""
    path = resolve_model(None).path
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_prompt = AutoTokenizer.from_pretrained(path).apply_chat_template(QUESTION, add_generation_prompt=True)
    adapter = write_adapter(tmp_path / "lora", hf.config, ["q_proj", "down_proj"], rank=4, alpha=4, seed=5, std=0.05)
    with LLM(dtype="float32", enable_lora=True, lora_modules=[f"a={adapter}"], **GPU_TEST_KV) as llm:
        prompt = llm.chat_prompt(QUESTION)  # the API server's template and tokenizer: transformers' prompt
        assert prompt == list(hf_prompt["input_ids"] if hasattr(hf_prompt, "keys") else hf_prompt)
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        params = SamplingParams(max_tokens=32, min_tokens=32, temperature=0)
        outs = llm.generate(["Hello", prompt, "Count to five:"], [SamplingParams(max_tokens=4), params,
                                                                  SamplingParams(max_tokens=2)])  # fmt: skip
        assert outs[1].token_ids == ref[0, len(prompt) :].tolist()
        assert "Paris" in outs[1].text
        assert [len(o.token_ids) for o in (outs[0], outs[2])] == [4, 2]
        assert outs[2].finish_reason == "length"
        with torch.inference_mode():
            ref = merged(hf, adapter).generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                                               do_sample=False)  # fmt: skip
        assert ref[0, len(prompt) :].tolist() != outs[1].token_ids  # the adapter changes the answer
        assert llm.generate([prompt], params, lora="a")[0].token_ids == ref[0, len(prompt) :].tolist()


def test_second_load_of_the_default_model_is_fast() -> None:
    resolve_model(None)  # converted already (or now)
    start = time.perf_counter()
    path = resolve_model(None).path
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert time.perf_counter() - start < 5.0


def test_the_offline_llm_loads_neither_torch_nor_transformers() -> None:
    """Its process does text work only (the engine core runs the model): importing torch and transformers there
    took 4 of the CLI's 18 s."""
    code = "import sys, frontend.offline.llm; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
