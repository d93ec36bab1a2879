"""N-gram speculative decoding, one stream: the engine core (direct ZMQ) with and without --speculative-config, and
transformers `generate` with and without its own prompt lookup (`prompt_lookup_num_tokens`), all in one run on
the same chat prompts, one request at a time, greedy, each ending at EOS or max_tokens.

python -m bench.speculative [--dataset-path bench/data/edits.jsonl] [--num-speculative-tokens 4] [--rounds 2]

Reports output tok/s per side (tokens over the wall time of all requests), the draft tokens the engine proposed and
how many it kept, and whether the engine's tokens with drafts equal its tokens without (they must: greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from bench.serve import machine
from common.config import EngineConfig
from common.messages import EngineRequest, SamplingParams
from common.model_source import resolve_model
from frontend.offline.engine_link import EngineClient, token_ids


def chat_prompts(path: str, tokenizer) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per line of a bench/data JSONL file."""
    prompts = []
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        text = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False) \
            if "messages" in row else row["prompt"]  # fmt: skip
        prompts.append((tokenizer(text)["input_ids"], row.get("max_tokens", 256)))
    return prompts


def run_engine(prompts: list[tuple[list[int], int]], spec: str | None, rounds: int) -> dict:
    config = EngineConfig(dtype="bfloat16", speculative_config=spec, enable_prefix_caching=False)
    with EngineClient(config) as engine:
        engine.generate([EngineRequest("warmup", prompts[0][0], SamplingParams(max_tokens=8, temperature=0.0))])
        tokens: list[list[int]] = []
        start = time.perf_counter()
        for r in range(rounds):
            for i, (ids, max_tokens) in enumerate(prompts):
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
                out = engine.generate([EngineRequest(f"{r}-{i}", ids, params)])
                tokens.append(token_ids(out[f"{r}-{i}"]))
        elapsed = time.perf_counter() - start
        stats = engine.call("stats").stats
    generated = sum(map(len, tokens))
    return {"speculative_config": spec, "output_tokens": generated, "seconds": elapsed,
            "output_tok_s": generated / elapsed, "draft_tokens": stats.num_draft_tokens if stats else 0,
            "accepted_tokens": stats.num_accepted_tokens if stats else 0, "tokens": tokens}  # fmt: skip


def run_hf(prompts: list[tuple[list[int], int]], lookup: int | None, rounds: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = AutoModelForCausalLM.from_pretrained(resolve_model(None).path, dtype=torch.bfloat16).eval()
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    generated = 0
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][0]]), max_new_tokens=8, do_sample=False, **extra)
        start = time.perf_counter()
        for _ in range(rounds):
            for ids, max_tokens in prompts:
                out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, **extra)
                generated += out.shape[1] - len(ids)
        elapsed = time.perf_counter() - start
    return {"prompt_lookup_num_tokens": lookup, "output_tokens": generated, "seconds": elapsed,
            "output_tok_s": generated / elapsed}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset-path", default="bench/data/edits.jsonl")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the prompts on each side")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--result-json")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    prompts = chat_prompts(args.dataset_path, AutoTokenizer.from_pretrained(resolve_model(None).path))
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                       "prompt_lookup_max": args.prompt_lookup_max})  # fmt: skip
    plain = run_engine(prompts, None, args.rounds)
    drafted = run_engine(prompts, spec, args.rounds)
    hf = [] if args.skip_hf else [run_hf(prompts, None, args.rounds),
                                  run_hf(prompts, args.num_speculative_tokens, args.rounds)]  # fmt: skip
    same = plain.pop("tokens") == drafted.pop("tokens")
    print(f"=== one stream, {len(prompts)} prompts x {args.rounds} rounds from {args.dataset_path}, bf16, greedy ===")
    print(f"{'roseinfer engine':38} {plain['output_tok_s']:7.1f} tok/s ({plain['output_tokens']} tokens)")
    print(f"roseinfer engine, {spec}")
    print(f"                                       {drafted['output_tok_s']:7.1f} tok/s ({drafted['output_tokens']} "
          f"tokens), drafts kept {drafted['accepted_tokens']}/{drafted['draft_tokens']}, same tokens: {same}")
    for side in hf:
        name = f"transformers generate, lookup {side['prompt_lookup_num_tokens'] or 'off'}"
        print(f"{name:38} {side['output_tok_s']:7.1f} tok/s ({side['output_tokens']} tokens)")
    if hf:
        print(f"with drafts / transformers with its lookup: {drafted['output_tok_s'] / hf[1]['output_tok_s']:.2f}x; "
              f"without / without: {plain['output_tok_s'] / hf[0]['output_tok_s']:.2f}x")
    print(f"with drafts / without: {drafted['output_tok_s'] / plain['output_tok_s']:.2f}x")
    if args.result_json:
        result = {"settings": {**vars(args), "machine": machine()}, "engine": plain, "engine_speculative": drafted,
                  "same_tokens": same, "hf": hf}  # fmt: skip
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
