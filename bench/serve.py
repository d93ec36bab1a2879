"""Serving benchmark: streams requests at an OpenAI-compatible endpoint; reports TTFT/TPOT/ITL/E2E, throughput, goodput.

python -m bench.serve --base-url http://127.0.0.1:8000 [--endpoint /v1/completions|/v1/chat/completions]
    [--dataset random --input-len 128 --output-len 128 --range-ratio 0 --prefix-len 0 | --dataset-path F.jsonl]
    [--num-prompts 64] [--request-rate inf --burstiness 1] [--max-concurrency N | --sweep-concurrency 1,4,16,64]
    [--goodput ttft:500 tpot:50] [--result-json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

if not __package__:  # run as a file (python bench/x.py), not with -m: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.serve_metrics import SLO_KEYS, RequestResult, parse_goodput, plot_runs, print_run, summarize  # noqa: E402


@dataclass
class BenchRequest:
    prompt: str | list[int] | list[dict[str, str]]  # completions text or ids, or chat messages
    output_len: int


# ---------------------------------------------------------------- datasets


def load_tokenizer(path: str | None) -> Any:
    from transformers import AutoTokenizer

    from common.model_source import resolve_model

    return AutoTokenizer.from_pretrained(path or resolve_model(None).path)


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float, prefix_len: int, seed: int,
                    tokenizer: Any, as_chat: bool) -> list[BenchRequest]:  # fmt: skip
    """Prompts of random non-special token ids: prefix_len shared + input_len (+-range_ratio) own tokens."""
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    vocab = np.array([i for i in range(len(tokenizer)) if i not in special])

    def lengths(mean: int) -> np.ndarray:
        lo, hi = max(int(mean * (1 - range_ratio)), 1), max(int(mean * (1 + range_ratio)), 1)
        return rng.integers(lo, hi + 1, size=n)

    prefix = rng.choice(vocab, size=prefix_len).tolist()
    out: list[BenchRequest] = []
    for in_len, out_len in zip(lengths(input_len), lengths(output_len), strict=True):
        ids = prefix + rng.choice(vocab, size=int(in_len)).tolist()
        # Chat takes text: the decoded ids re-tokenize to roughly (not exactly) the same length.
        prompt: Any = [{"role": "user", "content": tokenizer.decode(ids)}] if as_chat else ids
        out.append(BenchRequest(prompt, int(out_len)))
    return out


def file_requests(path: str, n: int, output_len: int, seed: int, tokenizer: Any, as_chat: bool) -> list[BenchRequest]:
    """JSONL of {"messages": [...]} or {"prompt": "..."}, optional "max_tokens"; cycled/shuffled to n requests."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise SystemExit(f"{path}: no prompts")
    order = np.random.default_rng(seed).permutation(max(n, len(rows)))[:n] % len(rows)
    out: list[BenchRequest] = []
    for row in (rows[i] for i in order):
        if "messages" in row:
            prompt: Any = row["messages"] if as_chat else tokenizer.apply_chat_template(
                row["messages"], add_generation_prompt=True, tokenize=False)  # fmt: skip
        else:
            prompt = [{"role": "user", "content": row["prompt"]}] if as_chat else row["prompt"]
        out.append(BenchRequest(prompt, int(row.get("max_tokens", output_len))))
    return out


def build_requests(args: argparse.Namespace, seed: int, tokenizer: Any | None = None,
                   n: int | None = None) -> list[BenchRequest]:  # fmt: skip
    as_chat, n = args.endpoint.endswith("/chat/completions"), args.num_prompts if n is None else n
    tokenizer = tokenizer or load_tokenizer(args.tokenizer)
    if args.dataset_path:
        return file_requests(args.dataset_path, n, args.output_len, seed, tokenizer, as_chat)
    return random_requests(n, args.input_len, args.output_len, args.range_ratio, args.prefix_len, seed, tokenizer,
                           as_chat)  # fmt: skip


def warmup_requests(args: argparse.Namespace, run_index: int, tokenizer: Any) -> list[BenchRequest]:
    # Another seed than any measured run, so warmups leave nothing in the prefix cache for it.
    return build_requests(args, args.seed + 7919 * (run_index + 1), tokenizer, args.num_warmups)


# ---------------------------------------------------------------- one request


def request_body(args: argparse.Namespace, model: str, req: BenchRequest) -> dict[str, Any]:
    key = "messages" if args.endpoint.endswith("/chat/completions") else "prompt"
    body = {"model": model, key: req.prompt, "max_tokens": req.output_len, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if args.ignore_eos:  # a vLLM/roseinfer extension: only sent when asked for
        body["ignore_eos"] = True
    for name in ("top_p", "top_k", "min_p"):  # as vLLM's client: sent only when given
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    return {**body, **(args.extra_body or {})}


async def send_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> RequestResult:
    res = RequestResult()
    start = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
                return res
            await read_stream(resp.content, res, start)
        res.e2e = time.perf_counter() - start
        if res.output_tokens == 0 and not res.error:
            res.error = "no usage chunk in the stream (stream_options.include_usage unsupported?)"
        elif res.ttft == 0.0 and not res.error:
            res.error = "no content chunk in the stream"
        res.ok = not res.error
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:  # ValueError: bad JSON, a huge line
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


async def read_stream(lines: AsyncIterator[bytes], res: RequestResult, start: float) -> None:
    """SSE lines into `res`: the first content chunk's time (TTFT), the gaps between content chunks, usage."""
    last = start
    async for raw in lines:
        if not raw.startswith(b"data:") or (data := raw[5:].strip()) == b"[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            res.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
            return
        if usage := chunk.get("usage"):
            res.prompt_tokens, res.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        for choice in chunk.get("choices") or []:
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if not text:  # the chat role opening and finish chunks carry no content
                continue
            now = time.perf_counter()
            if res.ttft == 0.0:
                res.ttft = now - start
            else:
                res.itl.append(now - last)
            last = now


# ---------------------------------------------------------------- one run


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gamma(shape=burstiness, mean=1/rate) gaps: burstiness 1 is Poisson, <1 burstier, >1 more even."""
    if math.isinf(rate):
        return [0.0] * n
    return np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n).tolist()


async def run_once(args: argparse.Namespace, client: aiohttp.ClientSession, model: str, requests: list[BenchRequest],
                   concurrency: int | None, seed: int, warmup: bool = False) -> dict[str, Any]:  # fmt: skip
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    desc = f"{'warmup, ' if warmup else ''}concurrency {concurrency or 'inf'}"
    bar = tqdm(total=len(requests), desc=desc, disable=args.disable_tqdm)
    rate = math.inf if warmup else args.request_rate

    async def one(req: BenchRequest) -> RequestResult:
        if sem is None:
            res = await send_request(client, args.endpoint, request_body(args, model, req))
        else:
            async with sem:
                res = await send_request(client, args.endpoint, request_body(args, model, req))
        bar.update()
        return res

    tasks = []
    start = time.perf_counter()
    for i, (req, gap) in enumerate(zip(requests, arrival_gaps(len(requests), rate, args.burstiness, seed),
                                       strict=True)):  # fmt: skip
        if i:  # the first request goes at t=0
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    # The load average tells a reader whether other work shared the CPUs with this run.
    return {"max_concurrency": concurrency, **summarize(results, duration, parse_goodput(args.goodput)),
            "load_avg_1m": os.getloadavg()[0]}  # fmt: skip


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:  # platform.processor() is often empty on Linux
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu_count": len(os.sched_getaffinity(0)), "processor": cpu, "platform": platform.platform()}


# ---------------------------------------------------------------- entry points


async def served_model(client: aiohttp.ClientSession) -> str:
    async with client.get("/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def benchmark(args: argparse.Namespace, tokenizer: Any | None = None) -> dict[str, Any]:
    """Every run of one invocation (one per --sweep-concurrency value) plus the settings; prints each run."""
    if args.ignore_eos is None:  # random prompts run to their length; real conversations may stop early
        args.ignore_eos = args.dataset_path is None
    levels = [int(c) for c in args.sweep_concurrency.split(",")] if args.sweep_concurrency else [args.max_concurrency]
    # aiohttp, as vLLM's client: httpx's connection pool scans every connection on each request and response, which
    # at 256 streams took most of this process's CPU (and delayed what it measured) before the server was busy.
    # A connection per request (0.1 ms here): llama-server closed kept-alive ones under aiohttp, failing 1 in 8.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # the semaphore is the only cap
    timeout = aiohttp.ClientTimeout(total=args.timeout, sock_connect=30.0)
    async with aiohttp.ClientSession(args.base_url, connector=connector, timeout=timeout,
                                     read_bufsize=2**20) as client:  # fmt: skip
        model = args.model or await served_model(client)
        tokenizer = tokenizer or load_tokenizer(args.tokenizer)
        runs = []
        for i, level in enumerate(levels):
            if args.num_warmups:  # unmeasured, workload-shaped: a cold server pays first-time costs per batch shape
                await run_once(args, client, model, warmup_requests(args, i, tokenizer), level, args.seed, warmup=True)
            # A fresh seed per run: repeating prompts would turn later runs into prefix-cache hits.
            requests = build_requests(args, args.seed + i, tokenizer)
            runs.append(await run_once(args, client, model, requests, level, args.seed + i))
            print_run(runs[-1])
    settings = {k: "inf" if v == math.inf else v for k, v in vars(args).items()}  # strict JSON has no Infinity
    settings.update(model=model, dataset=args.dataset_path or "random", machine=machine(),
                    date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"))  # fmt: skip
    return {"settings": settings, "runs": runs}


def add_args(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--base-url", default="http://127.0.0.1:8000")
    a("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    a("--model", default=None, help="default: the first model the server lists at /v1/models")
    a("--tokenizer", default=None, help="HF tokenizer dir (default: the default model's)")
    a("--num-prompts", type=int, default=64)
    a("--dataset-path", default=None, help="JSONL prompt file (default: random token prompts)")
    a("--input-len", type=int, default=128)
    a("--output-len", type=int, default=128)
    a("--range-ratio", type=float, default=0.0, help="lengths uniform in [L*(1-r), L*(1+r)]")
    a("--prefix-len", type=int, default=0, help="random tokens every prompt shares at its start")
    a("--ignore-eos", action=argparse.BooleanOptionalAction, default=None, help="default: on for random data")
    a("--temperature", type=float, default=0.0)
    a("--top-p", type=float, default=None)
    a("--top-k", type=int, default=None)
    a("--min-p", type=float, default=None)
    a("--request-rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    a("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    a("--max-concurrency", type=int, default=None)
    a("--sweep-concurrency", default=None, help="comma-separated concurrencies, one run each")
    a("--goodput", nargs="+", default=None, metavar="KEY:MS", help=f"SLOs, KEY in {SLO_KEYS}")
    a("--num-warmups", type=int, default=1, help="unmeasured requests of the workload's shape before each run")
    a("--timeout", type=float, default=600.0, help="seconds per request")
    a("--seed", type=int, default=0)
    a("--extra-body", type=json.loads, default=None, help='fields for every request: \'{"top_k": 20}\'')
    a("--disable-tqdm", action="store_true")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    parser.add_argument("--result-json", default=None)
    parser.add_argument("--plot", default=None, help="PNG: latency percentiles and throughput against concurrency")
    args = parser.parse_args()
    result = asyncio.run(benchmark(args))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        data = args.dataset_path or f"random {args.input_len} in / {args.output_len} out"
        plot_runs(result["runs"], args.plot, f"{result['settings']['model']} {args.endpoint} ({data}, "
                  f"{machine()['cpu_count']} CPUs)")  # fmt: skip
    if any(r["completed"] == 0 for r in result["runs"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
