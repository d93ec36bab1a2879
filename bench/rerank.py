"""Rerank throughput: our pooling server serving a causal Qwen3 as Qwen3-Reranker (vLLM's --hf-overrides and the
Qwen3-Reranker prompt, examples/qwen3_reranker.jinja) over HTTP, the client beside it as a RAG pipeline runs, against
transformers on padded batches the way Qwen3-Reranker's model card scores (the causal LM's last-position "yes" and
"no" logits; only the last position through the LM head), in the same run, alternating.

python -m bench.rerank --model DIR [--queries 16] [--documents 32] [--min-words 40] [--max-words 160]
                       [--concurrency 4] [--hf-batch-sizes 8,32] [--pairs 2] [--vllm-serve SCRIPT] [--result-json PATH]

Each query's documents go in one /rerank request, `concurrency` in flight. Texts are random vocabulary words
(seeded, distinct), so only the shared prompt prefix of the template is ever a prefix-cache hit. A server's figure
is the wall time from the first request sent to the last answer read; HF's, the best of its batch sizes. Every
server's scores are checked against HF's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from bench.servers import free_port, launched, served_model
from frontend.text.chat_template import environment

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "examples" / "qwen3_reranker.jinja"
OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
             "is_original_qwen3_reranker": True}  # fmt: skip


def random_texts(vocab: Tokenizer, n: int, low: int, high: int, seed: int) -> list[str]:
    """Texts of `low` to `high` random words: vocabulary entries that are plain lowercase words."""
    words = sorted(w.removeprefix("Ġ") for w in vocab.get_vocab() if w.removeprefix("Ġ").isalpha()
                   and w.removeprefix("Ġ").islower())  # fmt: skip
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, int(rng.integers(low, high + 1)))) for _ in range(n)]


def prompts(vocab: Tokenizer, query: str, documents: list[str]) -> list[list[int]]:
    template = environment().from_string(TEMPLATE.read_text())
    texts = [template.render(messages=[{"role": "query", "content": query}, {"role": "document", "content": d}])
             for d in documents]  # fmt: skip
    return [e.ids for e in vocab.encode_batch(texts, add_special_tokens=False)]


@torch.inference_mode()
def hf_pass(model: torch.nn.Module, inputs: list[list[int]], batch: int, no: int, yes: int) -> tuple[float, list]:
    """Seconds for one pass over every pair, length-sorted and left-padded, and each pair's score (input order)."""
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    scores = [0.0] * len(inputs)
    start = time.perf_counter()
    for lo in range(0, len(order), batch):
        rows = [inputs[i] for i in order[lo : lo + batch]]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        last = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1].float()
        for i, p in zip(order[lo : lo + batch], torch.sigmoid(last[:, yes] - last[:, no]), strict=True):
            scores[i] = float(p)
    return time.perf_counter() - start, scores


async def serve_pass(url: str, queries: list[str], documents: list[list[str]], concurrency: int) -> tuple[float, list]:
    """Seconds from the first request to the last answer, and every pair's score (query by query, document order)."""
    results: list[list[float]] = [[] for _ in queries]
    queue = list(range(len(queries)))
    model = served_model(url)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def worker() -> None:
            while queue:
                k = queue.pop(0)
                r = await client.post("/rerank", json={"model": model, "query": queries[k], "documents": documents[k]})
                r.raise_for_status()
                by_index = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
                results[k] = [by_index[i] for i in range(len(documents[k]))]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return seconds, [s for scores in results for s in scores]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="a causal Qwen3 (bench.make_random_model "
                        "qwen3-reranker-0.6b) with a tokenizer whose vocabulary has 'yes' and 'no'")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--documents", type=int, default=32, help="documents per query")
    parser.add_argument("--min-words", type=int, default=40)
    parser.add_argument("--max-words", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=4, help="rerank requests in flight")
    parser.add_argument("--hf-batch-sizes", default="8,32")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--roseinfer-args", default="", help="more launch.py flags")
    parser.add_argument("--vllm-serve", type=Path, help="a script run as SCRIPT MODEL_DIR PORT that serves the model "
                        "as a reranker with vLLM (the same overrides and template): measured after ours in each pair")
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args()
    vocab = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    queries = random_texts(vocab, args.queries, 6, 16, seed=1)
    documents = [random_texts(vocab, args.documents, args.min_words, args.max_words, seed=100 + q)
                 for q in range(args.queries)]  # fmt: skip
    inputs = [ids for q, docs in zip(queries, documents, strict=True) for ids in prompts(vocab, q, docs)]
    tokens = sum(map(len, inputs))
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    no, yes = vocab.token_to_id("no"), vocab.token_to_id("yes")
    hf_pass(hf, inputs[:2], 2, no, yes)  # warm-up
    servers = {"roseinfer": [sys.executable, "launch.py", "--model", str(args.model), "--dtype", args.dtype,
                             "--hf-overrides", json.dumps(OVERRIDES), "--chat-template", str(TEMPLATE),
                             "--log-level", "warning", *args.roseinfer_args.split()]}  # fmt: skip
    if args.vllm_serve:
        servers["vLLM"] = ["bash", str(args.vllm_serve.resolve()), str(args.model)]
    pairs = []
    for pair in range(args.pairs):
        runs: dict = {"hf_s": {}}
        for batch in map(int, args.hf_batch_sizes.split(",")):
            runs["hf_s"][batch], reference = hf_pass(hf, inputs, batch, no, yes)
        best = min(runs["hf_s"].values())
        for name, cmd in servers.items():  # one server at a time: neither takes memory or CPU from the other
            port = free_port()
            cmd = [*cmd, "--port", str(port)] if name == "roseinfer" else [*cmd, str(port)]
            with launched(cmd, port, Path(f"/tmp/bench_rerank_{name}.log")) as url:
                asyncio.run(serve_pass(url, queries[:1], [documents[0][:2]], 1))  # warm-up
                seconds, scores = asyncio.run(serve_pass(url, queries, documents, args.concurrency))
            error = max(abs(a - b) for a, b in zip(scores, reference, strict=True))
            runs[name] = {"s": seconds, "pairs_per_s": len(inputs) / seconds, "tok_per_s": tokens / seconds,
                          "over_hf": best / seconds, "max_score_error_to_hf": error}  # fmt: skip
            print(f"pair {pair} {name}: {len(inputs) / seconds:.2f} pairs/s ({tokens / seconds:.0f} tok/s), "
                  f"{best / seconds:.2f}x HF's best {runs['hf_s']}, max score error to HF {error:.4f}", flush=True)
        pairs.append(runs)
    result = {"model": str(args.model), "dtype": args.dtype, "queries": args.queries, "documents": args.documents,
              "words": [args.min_words, args.max_words], "pairs_scored": len(inputs), "tokens": tokens,
              "concurrency": args.concurrency, "pairs": pairs,
              "machine": {"cpus": len(os.sched_getaffinity(0)), "processor": platform.processor() or platform.machine(),
                          "torch": torch.__version__},
              "date": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
