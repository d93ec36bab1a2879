"""Embedding throughput: our pooling server over HTTP (the client beside it, as an indexing job runs) against
transformers' base model on padded batches (what sentence-transformers' encode does: inputs sorted by length, cut
into batches, the last token's hidden state normalized), in the same run, alternating.

python -m bench.embed --model DIR [--num-inputs 128] [--min-len 16] [--max-len 256] [--request-inputs 32]
                      [--concurrency 4] [--hf-batch-sizes 8,32] [--pairs 2] [--vllm-serve SCRIPT] [--result-json PATH]

Inputs are random token ids (no tokenizer on either side; seeded, so every pass embeds the same ones), distinct, so
no prefix-cache hit helps a server. A server's figure is the wall time from the first request sent to the last answer
read; HF's, the best of its batch sizes in the same pair. All in --dtype on all the machine's cores, one at a time;
each server's embeddings are checked against HF's (cosine).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from transformers import AutoModel

from bench.servers import free_port, launched, served_model


def random_inputs(n: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab, int(rng.integers(low, high + 1))).tolist() for _ in range(n)]


@torch.inference_mode()
def hf_pass(model: torch.nn.Module, inputs: list[list[int]], batch: int) -> tuple[float, list[np.ndarray]]:
    """Seconds for one sentence-transformers-style pass, and each input's normalized embedding (input order)."""
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    out: list[np.ndarray] = [np.empty(0)] * len(inputs)
    start = time.perf_counter()
    for lo in range(0, len(order), batch):
        rows = [inputs[i] for i in order[lo : lo + batch]]
        width = max(map(len, rows))  # left padding: every row's last token is the last column
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        last = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1].float()
        for i, vector in zip(order[lo : lo + batch], torch.nn.functional.normalize(last, dim=-1), strict=True):
            out[i] = vector.numpy()
    return time.perf_counter() - start, out


async def serve_pass(url: str, inputs: list[list[int]], per_request: int, concurrency: int,
                     ) -> tuple[float, list[np.ndarray]]:  # fmt: skip
    """Seconds from the first request to the last answer, `concurrency` requests of `per_request` inputs in flight."""
    chunks = [inputs[i : i + per_request] for i in range(0, len(inputs), per_request)]
    results: list[list[np.ndarray]] = [[] for _ in chunks]
    queue = list(enumerate(chunks))
    model = served_model(url)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def worker() -> None:
            while queue:
                k, chunk = queue.pop(0)
                body = {"model": model, "input": chunk, "encoding_format": "base64"}
                r = await client.post("/v1/embeddings", json=body)
                r.raise_for_status()
                results[k] = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in r.json()["data"]]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return seconds, [v for chunk in results for v in chunk]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-inputs", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--request-inputs", type=int, default=32, help="inputs per HTTP request")
    parser.add_argument("--concurrency", type=int, default=4, help="HTTP requests in flight")
    parser.add_argument("--hf-batch-sizes", default="8,32")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--roseinfer-args", default="", help="more launch.py flags")
    parser.add_argument("--vllm-serve", type=Path, help="a script run as SCRIPT MODEL_DIR PORT that serves the model "
                        "with vLLM's --runner pooling: vLLM is measured too, started after ours in each pair")
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args()
    config = json.loads((args.model / "config.json").read_text())
    inputs = random_inputs(args.num_inputs, args.min_len, args.max_len, config["vocab_size"], seed=0)
    tokens = sum(map(len, inputs))
    hf = AutoModel.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    hf_pass(hf, inputs[:2], 2)  # warm-up
    servers = {"roseinfer": [sys.executable, "launch.py", "--model", str(args.model), "--dtype", args.dtype,
                             "--log-level", "warning", *args.roseinfer_args.split()]}  # fmt: skip
    if args.vllm_serve:
        servers["vLLM"] = ["bash", str(args.vllm_serve.resolve()), str(args.model)]
    pairs = []
    for pair in range(args.pairs):
        runs: dict = {"hf_s": {}}
        for batch in map(int, args.hf_batch_sizes.split(",")):
            runs["hf_s"][batch], reference = hf_pass(hf, inputs, batch)
        best = min(runs["hf_s"].values())
        for name, cmd in servers.items():  # one server at a time: neither takes memory or CPU from the other
            port = free_port()
            cmd = [*cmd, "--port", str(port)] if name == "roseinfer" else [*cmd, str(port)]
            with launched(cmd, port, Path(f"/tmp/bench_embed_{name}.log")) as url:
                asyncio.run(serve_pass(url, inputs[:2], 1, 1))  # warm-up
                seconds, vectors = asyncio.run(serve_pass(url, inputs, args.request_inputs, args.concurrency))
            cosine = min(float(np.dot(a, b)) for a, b in zip(vectors, reference, strict=True))
            runs[name] = {"s": seconds, "inputs_per_s": len(inputs) / seconds, "tok_per_s": tokens / seconds,
                          "over_hf": best / seconds, "min_cosine_to_hf": cosine}  # fmt: skip
            print(f"pair {pair} {name}: {len(inputs) / seconds:.2f} inputs/s ({tokens / seconds:.0f} tok/s), "
                  f"{best / seconds:.2f}x HF's best {runs['hf_s']}, min cosine to HF {cosine:.4f}", flush=True)
        pairs.append(runs)
    result = {"model": str(args.model), "dtype": args.dtype, "num_inputs": len(inputs), "tokens": tokens,
              "lengths": [args.min_len, args.max_len], "request_inputs": args.request_inputs,
              "concurrency": args.concurrency, "pairs": pairs,
              "machine": {"cpus": len(os.sched_getaffinity(0)), "processor": platform.processor() or platform.machine(),
                          "torch": torch.__version__},
              "date": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
