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
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from bench.servers import add_pair_flags, one_at_a_time, post_all, run_record, served_model, servers_to_compare
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
    model = served_model(url)
    bodies = [{"model": model, "query": q, "documents": docs} for q, docs in zip(queries, documents, strict=True)]
    seconds, answers = await post_all(url, "/rerank", bodies, concurrency)
    scores = []
    for answer, docs in zip(answers, documents, strict=True):
        by_index = {x["index"]: x["relevance_score"] for x in answer["results"]}
        scores += [by_index[i] for i in range(len(docs))]
    return seconds, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="a causal Qwen3 (bench.make_random_model "
                        "qwen3-reranker-0.6b) with a tokenizer whose vocabulary has 'yes' and 'no'")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--documents", type=int, default=32, help="documents per query")
    parser.add_argument("--min-words", type=int, default=40)
    parser.add_argument("--max-words", type=int, default=160)
    add_pair_flags(parser, "the model as a reranker (the same overrides and template)")
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
    servers = servers_to_compare(args, "--hf-overrides", json.dumps(OVERRIDES), "--chat-template", str(TEMPLATE))
    pairs = []
    for pair in range(args.pairs):
        runs: dict = {"hf_s": {}}
        for batch in map(int, args.hf_batch_sizes.split(",")):
            runs["hf_s"][batch], reference = hf_pass(hf, inputs, batch, no, yes)
        best = min(runs["hf_s"].values())
        for name, url in one_at_a_time(servers, "rerank"):
            asyncio.run(serve_pass(url, queries[:1], [documents[0][:2]], 1))  # warm-up
            seconds, scores = asyncio.run(serve_pass(url, queries, documents, args.concurrency))
            error = max(abs(a - b) for a, b in zip(scores, reference, strict=True))
            runs[name] = {"s": seconds, "pairs_per_s": len(inputs) / seconds, "tok_per_s": tokens / seconds,
                          "over_hf": best / seconds, "max_score_error_to_hf": error}  # fmt: skip
            print(f"pair {pair} {name}: {len(inputs) / seconds:.2f} pairs/s ({tokens / seconds:.0f} tok/s), "
                  f"{best / seconds:.2f}x HF's best {runs['hf_s']}, max score error to HF {error:.4f}", flush=True)
        pairs.append(runs)
    settings = {"model": str(args.model), "dtype": args.dtype, "queries": args.queries, "documents": args.documents,
                "words": [args.min_words, args.max_words], "pairs_scored": len(inputs), "tokens": tokens,
                "concurrency": args.concurrency}  # fmt: skip
    if args.result_json:
        args.result_json.write_text(json.dumps(run_record(settings, pairs), indent=2))


if __name__ == "__main__":
    main()
