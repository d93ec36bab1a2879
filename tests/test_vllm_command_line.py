"""vLLM's command lines parsed as they are: other names folded into our settings, the values this server always runs
with, flags that change nothing, and what is refused at the command line, before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import launch
from engine_core.device import pick_dtype


def test_vllms_other_names_fold_into_our_settings() -> None:
    engine, server = launch.parse_args(["--task", "embed", "--num-gpu-blocks-override", "300", "--async-scheduling",
                                        "--disable-fastapi-docs"])  # fmt: skip
    assert (engine.runner, engine.num_kv_blocks, engine.overlap_decode, server.enable_docs) == ("pooling", 300, "on",
                                                                                              False)  # fmt: skip
    engine, _ = launch.parse_args(["--task", "generate", "--runner", "generate", "--num-kv-blocks", "64",
                                   "--num-gpu-blocks-override", "64"])  # fmt: skip
    assert (engine.runner, engine.num_kv_blocks, engine.overlap_decode) == ("generate", 64, "auto")
    # Flags that change nothing here, and the values this server always runs with, are taken.
    taken = ["--trust-remote-code", "--swap-space", "16", "--download-dir", "/tmp", "--max-parallel-loading-workers",
             "2", "--disable-custom-all-reduce", "--enable-request-id-headers", "--kv-cache-dtype", "auto",
             "--load-format", "auto", "--tokenizer-mode", "auto", "--pipeline-parallel-size", "1",
             "--distributed-executor-backend", "mp", "--enable-chunked-prefill", "--preemption-mode", "recompute",
             "--api-server-count", "1", "--lora-dtype", "auto", "--guided-decoding-backend", "xgrammar",
             "--chat-template-content-format", "string", "--limit-mm-per-prompt", '{"image": 0, "video": {"count": 0}}',
             "--max-loras", "4", "--max-cpu-loras", "8", "--max-seq-len-to-capture", "8192",
             "--disable-frontend-multiprocessing", "--revision", "main", "--tokenizer-revision", "main",
             "--code-revision", "main", "--hf-token"]  # fmt: skip
    assert launch.parse_args(taken) == launch.parse_args([])
    # -O0 and cudagraph_mode NONE run eagerly; other levels, modes and torch.compile's keys change nothing
    no_graphs = [["-O0"], ["--optimization-level", "0"], ["--compilation-config", '{"cudagraph_mode": "NONE"}']]
    assert all(launch.parse_args(flags)[0].enforce_eager for flags in no_graphs)
    graphs = [["-O3"], ["-O", "1"], ["--compilation-config", "3"], ["--compilation-config", '{"cudagraph_mode": '
              '"FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4], "mode": 3}']]  # fmt: skip
    assert all(launch.parse_args(flags) == launch.parse_args([]) for flags in graphs)


@pytest.mark.parametrize(("flags", "message"), [
    (["--no-enable-chunked-prefill"], "prompts are always chunked"),
    (["--kv-cache-dtype", "fp8_e5m2"], "argument --kv-cache-dtype: invalid choice: 'fp8_e5m2'"),
    (["--pipeline-parallel-size", "2"], "argument --pipeline-parallel-size: invalid choice: 2"),
    (["--distributed-executor-backend", "ray"], "invalid choice: 'ray'"),
    (["--task", "embed", "--runner", "generate"], "--task embed contradicts --runner generate"),
    (["--num-kv-blocks", "8", "--num-gpu-blocks-override", "9"], "--num-gpu-blocks-override contradicts"),
    (["--overlap-decode", "off", "--async-scheduling"], "--async-scheduling contradicts --overlap-decode off"),
    (["--enable-docs", "--disable-fastapi-docs"], "--disable-fastapi-docs contradicts --enable-docs True"),
    (["-O4"], "argument -O/--optimization-level: invalid choice: 4"),
    (["--limit-mm-per-prompt", '{"image": 1}'], "this server takes text only"),
    (["--limit-mm-per-prompt", '{"video": {"count": 2, "num_frames": 8}}'], "this server takes text only"),
    (["--limit-mm-per-prompt", "image=2"], "--limit-mm-per-prompt is not JSON"),
    (["--chat-template-content-format", "openai"], "invalid choice: 'openai'"),
    (["--api-server-count", "4"], "invalid choice: 4"),
    (["--compilation-config", "{cudagraph_mode: NONE}"], "--compilation-config is not JSON"),
    (["--compilation-config", "[3]"], "--compilation-config must be a JSON object (or a level, 0 to 3)"),
    (["--compilation-config", '{"cudagraph_mode": "none"}'], "cudagraph_mode 'none' is not one of NONE, PIECEWISE"),
])  # fmt: skip
def test_a_vllm_flag_this_server_cannot_honour_is_a_usage_error(flags, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        launch.parse_args(flags)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_model_may_come_first_as_vllm_serve_takes_it(capsys) -> None:
    assert launch.parse_args(["/models/qwen", "--port", "9000"])[0].model == "/models/qwen"
    assert launch.parse_args(["/models/qwen", "--model", "/models/qwen"])[0].model == "/models/qwen"
    assert launch.parse_args([])[0].model is None  # the default model
    with pytest.raises(SystemExit):
        launch.parse_args(["/models/qwen", "--model", "/models/llama"])
    assert "the model is given twice" in capsys.readouterr().err


def test_a_model_swallowed_by_served_model_name_is_a_usage_error(tmp_path: Path, capsys) -> None:
    """--served-model-name takes several names, so a model after it became one more name and the server served its
    default model under that name; a name that is a model's path (a directory with a config.json, or a GGUF file),
    with no model given, is now an error."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "m.gguf").touch()
    (tmp_path / "plain").mkdir()
    for model in (str(tmp_path), str(tmp_path / "m.gguf")):
        with pytest.raises(SystemExit):
            launch.parse_args(["--served-model-name", "qwen", model])
        assert f"{model} is a path, taken as a --served-model-name: put the model first" in capsys.readouterr().err
    engine, server = launch.parse_args([str(tmp_path), "--served-model-name", "qwen", "q"])
    assert engine.model == str(tmp_path) and server.served_model_name == ["qwen", "q"]
    names = ["qwen", str(tmp_path / "plain"), "not-a-path"]  # names that are no model's path stay names
    assert launch.parse_args(["--served-model-name", *names])[1].served_model_name == names


def test_vllms_dtype_names_and_a_wrong_one_is_a_usage_error(capsys) -> None:
    """`--dtype half` (common in vLLM command lines) and `float` are vLLM's names for float16 and float32; any other
    name stops at the command line, where it used to reach the engine and end its start with a KeyError."""
    cpu = torch.device("cpu")
    for name, dtype in (("half", torch.float16), ("float16", torch.float16), ("float", torch.float32),
                        ("float32", torch.float32), ("bfloat16", torch.bfloat16)):  # fmt: skip
        assert launch.parse_args(["--dtype", name])[0].dtype == name
        assert pick_dtype(name, cpu) == dtype
    with pytest.raises(SystemExit):
        launch.parse_args(["--dtype", "fp16"])
    assert "argument --dtype: invalid choice: 'fp16'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dtype 'fp16' is not one of auto, float32, float, bfloat16"):
        pick_dtype("fp16", cpu)


def test_max_logprobs_is_checked_and_minus_1_is_the_vocabulary(capsys) -> None:
    assert launch.parse_args(["--max-logprobs", "-1"])[0].logprobs_limit(49152) == 49152
    assert launch.parse_args(["--max-logprobs", "100"])[0].logprobs_limit(50) == 50  # never past the vocabulary
    assert launch.parse_args([])[0].logprobs_limit(49152) == 20  # vLLM's default
    with pytest.raises(SystemExit):
        launch.parse_args(["--max-logprobs", "-2"])
    assert "--max-logprobs must be -1 (the whole vocabulary) or at least 0" in capsys.readouterr().err
