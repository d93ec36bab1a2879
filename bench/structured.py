"""Cost of constrained decoding, on the engine core in-process (no HTTP): one batch of chat requests run
unconstrained and then held to a JSON schema, output tok/s and time per step for each.

python -m bench.structured [--num-requests 32] [--max-tokens 96] [--repeat 2] [--modes plain,json_fast,json_short]
    [--num-threads N] [--result-json bench/results/structured.json]

`plain` uses only the EngineCore API that predates constrained decoding, so the same command run in a worktree
of an older commit measures unconstrained throughput before and after (--modes plain).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

if not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.config import EngineConfig  # noqa: E402
from common.messages import EngineRequest, SamplingParams  # noqa: E402

# Strings without maxLength keep xgrammar's per-step mask cheap (its cached token masks apply); short maxLength
# strings are masked token by token at run time (about 5-8 ms per row per step on this machine).
FAST = {"type": "object", "properties": {
    "name": {"type": "string"}, "species": {"enum": ["dog", "cat", "bird"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "friends": {"type": "array", "items": {"type": "string"}, "maxItems": 8}}, "required": ["name", "species", "age",
                                                                                          "friends"]}  # fmt: skip
SHORT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "city": {"type": "string", "maxLength": 12}}, "required": ["name", "city"]}
SCHEMAS = {"json_fast": FAST, "json_short": SHORT}


def requests(tokenizer: Any, mode: str, n: int, max_tokens: int, tag: str) -> list[EngineRequest]:
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Describe pet number {i} as JSON."}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        kw: dict[str, Any] = {}
        if mode in SCHEMAS:
            from common.messages import StructuredOutput  # absent before constrained decoding; only json modes

            kw["structured"] = StructuredOutput("json_schema", json.dumps(SCHEMAS[mode]))
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, **kw)
        out.append(EngineRequest(f"{tag}-{i}", ids, params))
    return out


def run(core: Any, reqs: list[EngineRequest]) -> dict[str, float]:
    for r in reqs:
        core.add_request(r)
    tokens = steps = 0
    finish: dict[str, int] = {}
    start = time.perf_counter()
    while core.has_work:
        for out in core.step():
            tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                finish[out.finish_reason.name] = finish.get(out.finish_reason.name, 0) + 1
        steps += 1
    elapsed = time.perf_counter() - start
    return {"output_tokens": tokens, "seconds": elapsed, "tok_per_s": tokens / elapsed, "steps": steps,
            "ms_per_step": 1e3 * elapsed / steps, "finish": finish}  # type: ignore[dict-item]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--modes", default="plain,json_fast,json_short")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: one per core)")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from common.model_source import resolve_model
    from engine_core.core import EngineCore

    core = EngineCore(EngineConfig(dtype=args.dtype, kv_cache_memory=1.0, num_threads=args.num_threads))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    modes = args.modes.split(",")
    for mode in modes:  # warm-up: kernels, oneDNN shapes, grammar compiles (cached afterwards)
        run(core, requests(tokenizer, mode, 4, 8, f"warm-{mode}"))
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for rep in range(args.repeat):  # alternating, so that the machine's phases hit every mode alike
        for mode in modes:
            res = run(core, requests(tokenizer, mode, args.num_requests, args.max_tokens, f"{mode}-{rep}"))
            results[mode].append(res)
            print(f"{mode:10s} rep {rep}: {res['tok_per_s']:7.1f} tok/s, {res['ms_per_step']:6.1f} ms/step, "
                  f"{res['output_tokens']} tokens, {res['finish']}", flush=True)
    summary = {"settings": vars(args), "runs": results}
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
