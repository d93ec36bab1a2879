"""vLLM's logging, HTTPS and compatibility flags: the periodic stats line, request and output logging, TLS, the root
path, the access log, logprobs limits, and a server started with a vLLM command line (tests/test_vllm_command_line.py
parses the rest)."""

from __future__ import annotations

import json
import logging
import math
import re
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

import launch
from common.config import ServerConfig
from common.messages import EngineOutput, EngineRequest, FinishReason, LoraRef, SamplingParams, SchedulerStats
from frontend.api.http_options import check_http_flags
from frontend.api.protocol import ChatCompletionRequest, CompletionRequest
from frontend.api.serving import ServingContext
from frontend.engine.request_stream import RequestStream
from frontend.errors import ApiError
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


def test_minus_1_asks_for_the_whole_vocabulary_within_max_logprobs() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": -1}
    wide = ServingContext(None, None, "m", 2048, 100, max_logprobs=100)  # type: ignore[arg-type]
    assert wide.checked_logprobs(ChatCompletionRequest(**chat), "top_logprobs").top_logprobs == 100
    completion = CompletionRequest(prompt="hi", logprobs=3, prompt_logprobs=-1)
    asked = wide.checked_logprobs(completion, "logprobs")
    assert (asked.logprobs, asked.prompt_logprobs) == (3, 100)
    narrow = ServingContext(None, None, "m", 2048, 100)  # type: ignore[arg-type]  # vLLM's default, 20
    with pytest.raises(ApiError, match="Requested prompt logprobs of 100, which is greater than max allowed: 20"):
        narrow.checked_logprobs(completion, "logprobs")
    with pytest.raises(ValidationError):  # -1 is the only negative k
        CompletionRequest(prompt="hi", logprobs=-2)


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


# ---- a server started with a vLLM command line's flags ----


def test_a_vllm_command_line_serves_https_and_logs_stats_and_requests(tmp_path: Path) -> None:
    key, cert = make_cert(tmp_path)
    flags = ["--log-level", "info", "--ssl-certfile", cert, "--ssl-keyfile", key, "--root-path", "/api",
             "--enable-log-requests", "--max-log-len", "6", "--disable-uvicorn-access-log", "--enable-docs",
             "--trust-remote-code", "--swap-space", "16", "--enable-chunked-prefill",
             "--enable-prompt-tokens-details", "--enable-log-outputs", "--max-logprobs", "5",
             "--return-tokens-as-token-ids", "--logprobs-mode", "processed_logprobs"]  # fmt: skip
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
            # --logprobs-mode processed_logprobs: the distribution each token was drawn from, top_k 2 of it here
            drawn = client.post("/v1/completions", json={**body, "temperature": 0.5, "top_k": 2, "max_tokens": 4})
            for top in drawn.json()["choices"][0]["logprobs"]["top_logprobs"]:
                kept = [lp for lp in top.values() if lp > -9999]  # a dropped token's -inf is reported as -9999
                assert len(kept) == 2 and sum(math.exp(lp) for lp in kept) == pytest.approx(1.0, abs=1e-4), top
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
        received, _ = [line for line in log.splitlines() if "received request cmpl-" in line]  # two completions
        assert re.search(r"\(engine 0\): prompt: 'The ca', prompt_token_ids: \[[\d, ]+\]( \.\.\. \(\d+ in all\))?, "
                         r"params: max_tokens=24, temperature=0\.0, ignore_eos=True, logprobs=5, lora: None$",
                         received), received  # fmt: skip
        finished, _ = [line for line in log.splitlines() if "finished request cmpl-" in line]
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
