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
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel

from bench.servers import add_pair_flags, one_at_a_time, post_all, run_record, served_model, servers_to_compare


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
    model = served_model(url)
    bodies = [{"model": model, "input": inputs[i : i + per_request], "encoding_format": "base64"}
              for i in range(0, len(inputs), per_request)]  # fmt: skip
    seconds, answers = await post_all(url, "/v1/embeddings", bodies, concurrency)
    return seconds, [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for a in answers for d in a["data"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-inputs", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--request-inputs", type=int, default=32, help="inputs per HTTP request")
    add_pair_flags(parser, "the model with its --runner pooling")
    args = parser.parse_args()
    config = json.loads((args.model / "config.json").read_text())
    inputs = random_inputs(args.num_inputs, args.min_len, args.max_len, config["vocab_size"], seed=0)
    tokens = sum(map(len, inputs))
    hf = AutoModel.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    hf_pass(hf, inputs[:2], 2)  # warm-up
    servers = servers_to_compare(args)
    pairs = []
    for pair in range(args.pairs):
        runs: dict = {"hf_s": {}}
        for batch in map(int, args.hf_batch_sizes.split(",")):
            runs["hf_s"][batch], reference = hf_pass(hf, inputs, batch)
        best = min(runs["hf_s"].values())
        for name, url in one_at_a_time(servers, "embed"):
            asyncio.run(serve_pass(url, inputs[:2], 1, 1))  # warm-up
            seconds, vectors = asyncio.run(serve_pass(url, inputs, args.request_inputs, args.concurrency))
            cosine = min(float(np.dot(a, b)) for a, b in zip(vectors, reference, strict=True))
            runs[name] = {"s": seconds, "inputs_per_s": len(inputs) / seconds, "tok_per_s": tokens / seconds,
                          "over_hf": best / seconds, "min_cosine_to_hf": cosine}  # fmt: skip
            print(f"pair {pair} {name}: {len(inputs) / seconds:.2f} inputs/s ({tokens / seconds:.0f} tok/s), "
                  f"{best / seconds:.2f}x HF's best {runs['hf_s']}, min cosine to HF {cosine:.4f}", flush=True)
        pairs.append(runs)
    settings = {"model": str(args.model), "dtype": args.dtype, "num_inputs": len(inputs), "tokens": tokens,
                "lengths": [args.min_len, args.max_len], "request_inputs": args.request_inputs,
                "concurrency": args.concurrency}  # fmt: skip
    if args.result_json:
        args.result_json.write_text(json.dumps(run_record(settings, pairs), indent=2))


if __name__ == "__main__":
    main()
