"""vLLM's logging, HTTPS and compatibility flags: the periodic stats line, request logging, TLS, the root path, the
access log, and the flags taken so that vLLM command lines run."""

from __future__ import annotations

import json
import logging
import re
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

import launch
from common.config import ServerConfig
from common.messages import EngineOutput, EngineRequest, FinishReason, LoraRef, SamplingParams, SchedulerStats
from engine_core.device import pick_dtype
from frontend.api.http_options import check_http_flags
from frontend.engine.request_stream import RequestStream
from frontend.metrics import Metrics
from frontend.request_log import RequestLog
from frontend.stats_log import INTERVAL_ENV, StatsLog, stats_line
from tests.conftest import Server

MODEL = "SmolLM2-135M-Instruct"


def make_cert(directory: Path, name: str = "server") -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)  # fmt: skip
    return str(key), str(cert)


# ---- the stats line ----


async def _no_refresh() -> None:
    return None


def test_the_stats_line_reads_the_metrics_and_goes_quiet_once_idle() -> None:
    metrics = Metrics("m", num_engines=2)
    stats = StatsLog(metrics, 2, _no_refresh, interval=10)
    start = stats.last_time
    assert stats.lines(start + 10) == []  # nothing happened: no line
    metrics.observe_prompt(300, engine=1)
    metrics.observe_generated(50, engine=1)
    metrics.observe_stats(SchedulerStats(num_running=3, num_waiting=2, kv_usage=0.125, prefix_queries=400,
                                         prefix_hits=100), engine=1)  # fmt: skip
    assert stats.lines(start + 20) == [
        "Engine 001: Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 3 reqs, "
        "Waiting: 2 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 25.0%"
    ]
    metrics.observe_stats(SchedulerStats(prefix_queries=400, prefix_hits=100), engine=1)  # all done
    metrics.observe_generated(20, engine=1)
    (line,) = stats.lines(start + 30)  # the engine still moved: a line, its rates over the last 10 s only
    assert "prompt throughput: 0.0 tokens/s, Avg generation throughput: 2.0 tokens/s, Running: 0 reqs" in line
    (line,) = stats.lines(start + 40)  # the first idle interval: one more line, showing it idle
    assert "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs" in line
    assert stats.lines(start + 50) == []  # then quiet


def test_a_stats_interval_that_is_not_a_positive_number_is_10_s(monkeypatch: pytest.MonkeyPatch) -> None:
    for text, seconds in (("2.5", 2.5), ("0", 10.0), ("-1", 10.0), ("nan", 10.0), ("often", 10.0)):
        monkeypatch.setenv(INTERVAL_ENV, text)
        assert StatsLog(Metrics("m"), 1, _no_refresh).interval == seconds


def test_the_stats_line_gives_the_draft_acceptance_where_drafts_ran() -> None:
    metrics = Metrics("m")
    before = metrics.engine_totals(0)
    metrics.observe_stats(SchedulerStats(num_running=1, num_draft_tokens=40, num_accepted_tokens=30))
    assert stats_line(0, before, metrics.engine_totals(0), 1.0).endswith(", Draft acceptance rate: 75.0%")
    assert "Draft" not in stats_line(0, before, before, 1.0)


# ---- request logging ----


def test_a_request_line_shows_the_prompt_cut_and_only_the_parameters_set(caplog: pytest.LogCaptureFixture) -> None:
    decoded: list[list[int]] = []

    def decode(ids: list[int]) -> str:
        decoded.append(ids)
        return "".join(chr(ord("a") + i) for i in ids)

    params = SamplingParams(max_tokens=7, temperature=0.0, stop_token_ids=[2])
    lora = LoraRef(1, "sql", "/adapters/sql")
    request = EngineRequest("cmpl-1#1", list(range(10)), params, lora=lora)
    with caplog.at_level(logging.INFO, logger="roseinfer.requests"):
        RequestLog(decode, max_len=4)(request, engine=1)
        RequestLog(decode)(EngineRequest("cmpl-2#2", [3, 4], SamplingParams()), engine=0)
    first, second = (r.getMessage() for r in caplog.records)
    assert decoded == [[0, 1, 2, 3], [3, 4]]  # only what is shown is decoded
    assert first == ("received request cmpl-1#1 (engine 1): prompt: 'abcd', prompt_token_ids: [0, 1, 2, 3] ... "
                     "(10 in all), params: max_tokens=7, temperature=0.0, stop_token_ids=[2], lora: sql")  # fmt: skip
    assert second == ("received request cmpl-2#2 (engine 0): prompt: 'de', prompt_token_ids: [3, 4], params: all "
                      "defaults, lora: None")  # fmt: skip


def test_an_output_line_shows_the_output_cut_and_why_it_ended(caplog: pytest.LogCaptureFixture) -> None:
    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)

    long, failed = (RequestStream(EngineRequest(rid, [7], SamplingParams()), None) for rid in ("c-1#1", "c-2#2"))
    long.on_finish, failed.on_finish = RequestLog(decode, max_len=4).output, RequestLog(decode).output
    with caplog.at_level(logging.INFO, logger="roseinfer.requests"):
        long.on_output(EngineOutput("c-1#1", list(range(5))))
        failed.on_output(EngineOutput("c-2#2", [3]))
        assert not caplog.records  # nothing until a request ends
        long.on_output(EngineOutput("c-1#1", list(range(5, 10)), FinishReason.LENGTH))
        failed.fail("the engine core died")
    first, second = (r.getMessage() for r in caplog.records)
    assert first == ("finished request c-1#1: output: 'abcd', output_token_ids: [0, 1, 2, 3] ... (10 in all), "
                     "finish_reason: length")  # fmt: skip
    assert second == ("finished request c-2#2: output: 'd', output_token_ids: [3], finish_reason: error (the engine "
                      "core died)")  # fmt: skip


def test_max_logprobs_is_checked_and_minus_1_is_the_vocabulary(capsys) -> None:
    assert launch.parse_args(["--max-logprobs", "-1"])[0].logprobs_limit(49152) == 49152
    assert launch.parse_args(["--max-logprobs", "100"])[0].logprobs_limit(50) == 50  # never past the vocabulary
    assert launch.parse_args([])[0].logprobs_limit(49152) == 20  # vLLM's default
    with pytest.raises(SystemExit):
        launch.parse_args(["--max-logprobs", "-2"])
    assert "--max-logprobs must be -1 (the whole vocabulary) or at least 0" in capsys.readouterr().err


# ---- flags checked at start ----


def test_http_flags_are_checked_before_anything_starts(tmp_path: Path) -> None:
    key, cert = make_cert(tmp_path)
    other_key, _ = make_cert(tmp_path, "other")
    check_http_flags(ServerConfig(ssl_certfile=cert, ssl_keyfile=key, root_path="/api"))  # fine
    bad = [
        (ServerConfig(root_path="api"), "--root-path"),
        (ServerConfig(root_path="/api/"), "--root-path"),
        (ServerConfig(ssl_certfile=str(tmp_path / "missing.pem")), "--ssl-certfile: no such file"),
        (ServerConfig(ssl_keyfile=key), "need --ssl-certfile"),
        (ServerConfig(ssl_certfile=cert, ssl_keyfile=key, ssl_cert_reqs=2), "--ssl-ca-certs, which is missing"),
        (ServerConfig(ssl_certfile=cert, ssl_keyfile=other_key), "--ssl-certfile/--ssl-keyfile"),  # not its key
    ]
    for config, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            check_http_flags(config)


def test_launch_refuses_what_it_cannot_do_before_the_engine_loads(capsys) -> None:
    assert launch.main(["--port", "1", "--ssl-certfile", "/nonexistent/cert.pem"]) == 2
    assert "--ssl-certfile: no such file" in capsys.readouterr().err


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
    (["--kv-cache-dtype", "fp8"], "argument --kv-cache-dtype: invalid choice: 'fp8'"),
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


# ---- a server started with a vLLM command line's flags ----


def test_a_vllm_command_line_serves_https_and_logs_stats_and_requests(tmp_path: Path) -> None:
    key, cert = make_cert(tmp_path)
    flags = ["--log-level", "info", "--ssl-certfile", cert, "--ssl-keyfile", key, "--root-path", "/api",
             "--enable-log-requests", "--max-log-len", "6", "--disable-uvicorn-access-log", "--enable-docs",
             "--trust-remote-code", "--swap-space", "16", "--enable-chunked-prefill",
             "--enable-prompt-tokens-details", "--enable-log-outputs", "--max-logprobs", "5",
             "--return-tokens-as-token-ids"]  # fmt: skip
    server = Server(tmp_path, *flags, env={INTERVAL_ENV: "0.5", "VLLM_API_KEY": "sk-env"})  # the key, as vLLM reads it
    trusted = ssl.create_default_context(cafile=cert)
    server.url, server.verify = server.url.replace("http://", "https://"), trusted
    try:
        server.wait_healthy()
        with httpx.Client(base_url=server.url, verify=trusted, timeout=120) as client:
            assert client.get("/v1/models").status_code == 401
            refused = client.post("/v1/messages", json={})  # behind the root path, still Anthropic's error shape here
            assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
            client.headers["Authorization"] = "Bearer sk-env"
            body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True, "logprobs": 5}  # fmt: skip
            answer = client.post("/v1/completions", json=body)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 24
            # --return-tokens-as-token-ids names tokens by id; --max-logprobs 5 allows 5 and refuses 6
            logprobs = answer.json()["choices"][0]["logprobs"]
            assert all(re.fullmatch(r"token_id:\d+", t) for t in logprobs["tokens"]) and len(logprobs["tokens"]) == 24
            assert all(len(top) == 5 for top in logprobs["top_logprobs"])
            too_many = client.post("/v1/completions", json={**body, "logprobs": 6, "prompt_logprobs": 1})
            assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs"
            assert "sample logprobs of 6, which is greater than max allowed: 5" in too_many.text
            # --enable-prompt-tokens-details: a prompt sent again finds its whole blocks in the prefix cache
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea. " * 8}],
                    "max_tokens": 2}  # fmt: skip
            cold = client.post("/v1/chat/completions", json=chat).json()["usage"]
            assert cold["prompt_tokens_details"] == {"cached_tokens": 0} and cold["prompt_tokens"] > 32
            streamed = client.post("/v1/chat/completions", json={**chat, "stream": True,
                                                                 "stream_options": {"include_usage": True}})
            final = json.loads(streamed.text.split("data: ")[-2])["usage"]  # the usage chunk, before [DONE]
            cached = final["prompt_tokens_details"]["cached_tokens"]
            assert 16 <= cached < cold["prompt_tokens"] and cached % 16 == 0, final  # whole blocks of 16 tokens
            asked = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                     "logprobs": True, "top_logprobs": 5, "return_tokens_as_token_ids": False}  # fmt: skip
            named = client.post("/v1/chat/completions", json=asked).json()["choices"][0]["logprobs"]["content"]
            assert not any(entry["token"].startswith("token_id:") for entry in named)  # the request's own choice
            schema = client.get("/openapi.json").json()
            assert schema["servers"] == [{"url": "/api"}]  # the URLs the API writes carry the proxy's prefix
        with pytest.raises(httpx.TransportError):  # HTTPS only
            httpx.get(server.url.replace("https://", "http://") + "/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate is refused
            httpx.get(server.url + "/health", timeout=5)
        server.assert_clean_exit()
        log = server.log.read_text()
        (received,) = [line for line in log.splitlines() if "received request cmpl-" in line]  # one completion
        assert re.search(r"\(engine 0\): prompt: 'The ca', prompt_token_ids: \[[\d, ]+\]( \.\.\. \(\d+ in all\))?, "
                         r"params: max_tokens=24, temperature=0\.0, ignore_eos=True, logprobs=5, lora: None$",
                         received), received  # fmt: skip
        (finished,) = [line for line in log.splitlines() if "finished request cmpl-" in line]
        ids = answer.json()["choices"][0]["logprobs"]["tokens"][:6]
        assert finished.endswith(f"output_token_ids: [{', '.join(t.split(':')[1] for t in ids)}] ... (24 in all), "
                                 "finish_reason: length"), finished  # fmt: skip
        assert re.search(r": output: (['\"]).*\1, output_token_ids", finished), finished
        generated = [float(m) for m in re.findall(r"Engine 000: .*Avg generation throughput: ([\d.]+) tokens/s", log)]
        assert any(rate > 0 for rate in generated), log[-3000:]
        assert f"serving {MODEL} on https://127.0.0.1:{server.port}\n" in log  # where it listens, said once up
        assert 'HTTP/1.1" 200' not in log  # no access log
        assert "Duplicate Operation ID" not in log  # the schema's operation ids are unique (GET and POST /ping)
    finally:
        server.stop()
