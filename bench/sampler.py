"""The sampler alone, for a decode step's batch: 64 rows of next-token logits that the default model computed for
64 chat prompts (bench/data/conversations.jsonl; bf16, as the engine hands them over), sampled with the settings
clients send. Prints the fastest and the median of --repeats calls per setting.

To compare two checkouts, run it from outside both, in turn (python -m puts the working directory first):
cd /tmp && PYTHONPATH=<checkout> python -m bench.sampler [--repeats 30] [--result-json F]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.messages import EngineRequest, SamplingParams
from common.model_source import resolve_model
from engine_core.request import Request
from engine_core.sampler import Sampler

DATA = Path(__file__).parent / "data" / "conversations.jsonl"
SETTINGS: dict[str, dict] = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7, top_p 0.95": {"temperature": 0.7, "top_p": 0.95},
    "temperature 0.7, top_k 50": {"temperature": 0.7, "top_k": 50},
    "Qwen2.5's defaults: t 0.7, top_p 0.8, top_k 20, repetition 1.05": {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
    "temperature 1, min_p 0.05": {"temperature": 1.0, "min_p": 0.05},
    "temperature 1, presence 0.5, frequency 0.5": {"temperature": 1.0, "presence_penalty": 0.5,
                                                   "frequency_penalty": 0.5},
}  # fmt: skip


def real_logits(rows: int, random_prompts: bool) -> tuple[torch.Tensor, list[list[int]]]:
    """The default model's next-token logits after `rows` chat prompts (or prompts of 128 random tokens, as
    benchmarks send, after which the model's next token is far less certain), and the prompts' ids."""
    path = resolve_model(None).path
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    records = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    chats = [r["messages"] for r in records if "messages" in r]  # (a few lines are plain prompts)
    prompts = [tok.apply_chat_template(chats[i % len(chats)], add_generation_prompt=True, return_dict=True)["input_ids"]
               for i in range(rows)]  # fmt: skip
    if random_prompts:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, tok.vocab_size, (128,), generator=gen).tolist() for _ in range(rows)]
    with torch.inference_mode():
        logits = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
    return logits.to(torch.bfloat16), [list(p) for p in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--random-prompts", action="store_true", help="128 random tokens each instead of chats")
    parser.add_argument("--pad-history", type=int, default=0,
                        help="random token ids put before each prompt in what penalties read (a long context)")
    parser.add_argument("--outputs", type=int, default=16, help="the history's last N tokens count as outputs")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    logits, prompts = real_logits(args.rows, args.random_prompts)
    sampler = Sampler(torch.device("cpu"), logits.shape[-1], seed=0)
    pad = torch.randint(0, logits.shape[-1], (args.rows, args.pad_history), generator=torch.Generator().manual_seed(1))
    history = [pad[i].tolist() + p for i, p in enumerate(prompts)]
    results = {}
    for name, fields in SETTINGS.items():
        params = SamplingParams(max_tokens=64, **fields)
        # The history's last tokens stand for outputs, so that penalties have tokens to count.
        cut = args.outputs
        reqs = [Request(EngineRequest(str(i), h[:-cut], params, eos_token_ids=[2], output_token_ids=h[-cut:]), i)
                for i, h in enumerate(history)]  # fmt: skip
        times = []
        for _ in range(args.repeats + 2):
            start = time.perf_counter()
            sampler(logits, reqs)
            times.append((time.perf_counter() - start) * 1000)
        times = times[2:]
        results[name] = {"min_ms": round(min(times), 2), "median_ms": round(statistics.median(times), 2)}
        print(f"{name:66s} min {min(times):8.2f} ms   median {statistics.median(times):8.2f} ms")
    if args.result_json:
        settings = {"rows": args.rows, "repeats": args.repeats, "random_prompts": args.random_prompts,
                    "pad_history": args.pad_history, "outputs": args.outputs,
                    "threads": torch.get_num_threads(),
                    "machine": platform.processor() or platform.machine(), "torch": torch.__version__}  # fmt: skip
        Path(args.result_json).write_text(json.dumps({"settings": settings, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
