"""bench/serve.py: metric math on synthetic timings, SSE parsing on a fake transport, a short run against launch.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from bench import compare, serve
from bench.serve_metrics import RequestResult, parse_goodput, stats_ms, summarize
from bench.servers import free_port, launched

REPO = Path(__file__).resolve().parent.parent


def test_metric_math_on_synthetic_timings() -> None:
    a = RequestResult(ok=True, ttft=0.1, e2e=0.5, itl=[0.1] * 4, prompt_tokens=10, output_tokens=5)
    # b's 3 tokens after the first came in merged chunks: TPOT counts tokens (usage), ITL counts chunks.
    b = RequestResult(ok=True, ttft=0.3, e2e=1.3, itl=[0.2, 0.3, 0.5], prompt_tokens=20, output_tokens=3)
    c = RequestResult(ok=True, ttft=0.2, e2e=0.2, prompt_tokens=5, output_tokens=1)  # one token: no TPOT
    bad = RequestResult(error="HTTP 500: boom")
    assert a.tpot == pytest.approx(0.1) and b.tpot == pytest.approx(0.5) and c.tpot is None

    s = summarize([a, b, c, bad], duration=2.0, slos={"ttft": 250.0, "tpot": 200.0})
    assert (s["sent"], s["completed"], s["failed"], s["first_errors"]) == (4, 3, 1, ["HTTP 500: boom"])
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (35, 9)
    assert s["request_throughput"] == pytest.approx(1.5) and s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(22.0)
    # TTFT 100/300/200 ms: numpy's linear percentiles.
    assert s["ttft_ms"] == pytest.approx({"mean": 200.0, "median": 200.0, "p90": 280.0, "p99": 298.0})
    assert s["tpot_ms"] == pytest.approx({"mean": 300.0, "median": 300.0, "p90": 460.0, "p99": 496.0})
    assert s["itl_ms"]["mean"] == pytest.approx(200.0) and s["itl_ms"]["median"] == pytest.approx(100.0)
    assert s["e2el_ms"]["mean"] == pytest.approx(2000.0 / 3)
    # a meets both SLOs, b misses TTFT, c has no TPOT and meets TTFT: 2 good requests in 2 s.
    assert s["goodput"] == pytest.approx(1.0)
    assert summarize([a, b], 1.0, {"tpot": 99.0})["goodput"] == 0.0
    assert summarize([a], 1.0, {})["goodput"] is None
    assert stats_ms([]) == {"mean": None, "median": None, "p90": None, "p99": None}
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:9000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 9000.0}
    with pytest.raises(SystemExit):
        parse_goodput(["itl:5"])


def test_compare_ratios() -> None:
    def run(tok_s: float, ttft: float, tpot: float | None) -> dict:
        return {"output_throughput": tok_s, "ttft_ms": {"median": ttft}, "tpot_ms": {"median": tpot}}

    assert compare.ratios(run(300.0, 50.0, 20.0), run(100.0, 100.0, 40.0)) == {
        "output_throughput": 3.0, "ttft_p50": 0.5, "tpot_p50": 0.5}  # fmt: skip
    assert compare.ratios(run(1.0, 1.0, None), run(1.0, 1.0, 2.0))["tpot_p50"] is None


def test_arrival_gaps() -> None:
    assert serve.arrival_gaps(5, math.inf, 1.0, 0) == [0.0] * 5
    for burstiness, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):  # gamma: CV = 1/sqrt(shape), mean 1/rate
        gaps = np.array(serve.arrival_gaps(40000, 10.0, burstiness, 1))
        assert gaps.mean() == pytest.approx(0.1, rel=0.05) and gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)
    assert serve.arrival_gaps(3, 2.0, 1.0, 7) == serve.arrival_gaps(3, 2.0, 1.0, 7)  # seeded


def _sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _send(body: bytes, status: int = 200) -> RequestResult:
    """serve.send_request against an aiohttp server that answers `body` with `status`, split into small writes."""

    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=status)
        await resp.prepare(request)
        for i in range(0, len(body), 7):  # lines arrive in pieces, as over a real socket
            await resp.write(body[i : i + 7])
        await resp.write_eof()
        return resp

    async def go() -> RequestResult:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client:
                return await serve.send_request(client, "/v1/chat/completions", {})
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_stream_parsing() -> None:
    chat = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},  # opening: not a token
            {"choices": [{"delta": {"content": "Hi"}}]}, {"choices": [{"delta": {"content": " there, friend"}}]},
            {"choices": [{"delta": {}, "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}]  # fmt: skip
    r = _send(_sse(*chat, "[DONE]"))
    assert r.ok and (r.prompt_tokens, r.output_tokens, len(r.itl)) == (9, 4, 1)
    assert 0 < r.ttft <= r.e2e and sum(r.itl) <= r.e2e - r.ttft  # gaps run from the previous chunk, not the start
    assert not (r := _send(_sse(*chat[:-1], "[DONE]"))).ok and "usage" in r.error
    assert not (r := _send(_sse(chat[1], {"error": {"message": "engine died"}}, "[DONE]"))).ok
    assert "engine died" in r.error
    assert not (r := _send(b'{"error": "nope"}', status=400)).ok and r.error.startswith("HTTP 400")


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "launch.py", "--port", str(port), "--dtype", "float32", "--num-kv-blocks", "512",
           "--max-model-len", "2048", "--log-level", "warning"]  # fmt: skip
    with launched(cmd, port, tmp_path_factory.mktemp("bench") / "server.log", timeout=180) as url:
        yield url


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def test_request_body_takes_extra_fields() -> None:
    """--extra-body merges its fields into every request, over the client's own (a constrained workload)."""
    parser = argparse.ArgumentParser()
    serve.add_args(parser)
    fmt = {"type": "json_object"}
    args = parser.parse_args(["--top-k", "5", "--extra-body", json.dumps({"response_format": fmt, "top_k": 7})])
    body = serve.request_body(args, "m", serve.BenchRequest([1, 2, 3], 16))
    assert body["response_format"] == fmt and body["top_k"] == 7 and body["prompt"] == [1, 2, 3]
    assert body["max_tokens"] == 16 and body["stream"] is True
    plain = serve.request_body(parser.parse_args([]), "m", serve.BenchRequest([1], 4))
    assert "response_format" not in plain and "top_k" not in plain


def test_serve_cli_sweep_json_and_plot(server_url: str, tmp_path: Path) -> None:
    out, png = tmp_path / "result.json", tmp_path / "plot.png"
    cmd = [sys.executable, "-m", "bench.serve", "--base-url", server_url, "--num-prompts", "8", "--input-len", "32",
           "--output-len", "8", "--sweep-concurrency", "1,4", "--request-rate", "40", "--burstiness", "0.5",
           "--goodput", "ttft:60000", "tpot:60000",
           "--result-json", str(out), "--plot", str(png), "--disable-tqdm"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Output token throughput" in proc.stdout and "TTFT" in proc.stdout

    result = json.loads(out.read_text())  # strict JSON: no NaN / Infinity
    settings = result["settings"]
    assert settings["model"] == "SmolLM2-135M-Instruct" and settings["endpoint"] == "/v1/completions"
    assert settings["machine"]["cpu_count"] >= 1 and settings["machine"]["processor"] and settings["date"]
    assert settings["seed"] == 0 and settings["dataset"] == "random" and settings["request_rate"] == 40.0
    assert [r["max_concurrency"] for r in result["runs"]] == [1, 4]
    for run in result["runs"]:
        scalars = ["sent", "completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
                   "request_throughput", "output_throughput", "total_token_throughput", "goodput",
                   "load_avg_1m"]  # fmt: skip
        assert all(_is_number(run[k]) for k in scalars), run
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert all(_is_number(run[key][s]) for s in ("mean", "median", "p90", "p99")), (key, run[key])
        assert run["completed"] + run["failed"] == run["sent"] == 8 and run["failed"] == 0, run["first_errors"]
        assert run["total_output_tokens"] == 8 * 8  # ignore_eos: every request runs to its length
        assert run["total_input_tokens"] == 8 * 32  # token-id prompts are sent as they are
        for s in ("mean", "median", "p90", "p99"):  # per-request TTFT <= E2E carries over to every order statistic
            assert 0 < run["ttft_ms"][s] <= run["e2el_ms"][s]
        assert 0 < run["goodput"] <= run["request_throughput"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_chat_endpoint_with_conversation_file(server_url: str) -> None:
    parser = argparse.ArgumentParser()
    serve.add_args(parser)
    args = parser.parse_args(["--base-url", server_url, "--endpoint", "/v1/chat/completions", "--dataset-path",
                              str(REPO / "bench/data/conversations.jsonl"), "--num-prompts", "4", "--output-len", "8",
                              "--max-concurrency", "4", "--disable-tqdm"])  # fmt: skip
    run = asyncio.run(serve.benchmark(args))["runs"][0]
    assert run["completed"] == 4, run["first_errors"]
    assert 0 < run["total_output_tokens"] <= 4 * 8 and run["total_input_tokens"] > 4 * 10  # chat template + content
