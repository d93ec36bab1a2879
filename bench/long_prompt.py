"""One long prompt's time to first token: roseinfer's engine core (direct ZMQ, no HTTP; the prompt chunked by
--max-num-batched-tokens, as the server does) beside transformers' forward over the same prompt (what `generate`
spends before its first token), measured in the same run on random prompt tokens. Best of --repeats, each on a new
prompt (no prefix-cache hits). With --quantization int8 or int4 our weights are quantized at load; transformers'
stay in --dtype.

python -m bench.long_prompt [--lengths 2048,8000] [--repeats 3] [--model DIR] [--quantization Q] [--hf-model DIR]
    [--result-json F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from bench.offline import load_hf, random_prompts
from common.config import EngineConfig
from common.messages import EngineRequest, SamplingParams
from frontend.offline.engine_link import EngineClient


def ours(lengths: list[int], repeats: int, config: EngineConfig) -> dict[int, list[float]]:
    seconds: dict[int, list[float]] = {}
    with EngineClient(config) as engine:
        engine.generate([EngineRequest("warmup", random_prompts(1, 64, 99)[0], SamplingParams(max_tokens=1))])
        for length in lengths:
            for r in range(repeats):
                prompt = random_prompts(1, length, 1000 * length + r)[0]
                start = time.perf_counter()
                engine.generate([EngineRequest(f"{length}-{r}", prompt, SamplingParams(max_tokens=1))])
                seconds.setdefault(length, []).append(time.perf_counter() - start)
    return seconds


def transformers_forward(lengths: list[int], repeats: int, dtype: str, model: str | None) -> dict[int, list[float]]:
    import torch

    hf = load_hf(model, dtype)
    seconds: dict[int, list[float]] = {}
    with torch.inference_mode():
        hf(torch.tensor(random_prompts(1, 64, 99)), logits_to_keep=1)
        for length in lengths:
            for r in range(repeats):
                prompt = torch.tensor(random_prompts(1, length, 1000 * length + r))
                start = time.perf_counter()
                hf(prompt, logits_to_keep=1)
                seconds.setdefault(length, []).append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,8000", help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--model", default=None, help="an HF directory or .gguf (default: the default model)")
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    parser.add_argument("--hf-model", default=None, help="transformers' model (default: --model), such as the plain "
                        "model a GPTQ, AWQ or compressed-tensors checkpoint was made from")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    config = EngineConfig(model=args.model, dtype=args.dtype, max_model_len=max(lengths) + 16,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          quantization=args.quantization)  # fmt: skip
    mine = ours(lengths, args.repeats, config)
    theirs = transformers_forward(lengths, args.repeats, args.dtype, args.hf_model or args.model)
    rows = {length: {"roseinfer_s": mine[length], "hf_forward_s": theirs[length],
                     "hf_over_ours": min(theirs[length]) / min(mine[length])} for length in lengths}  # fmt: skip
    result = {
        "workload": vars(args),
        "machine": {"cpus": len(os.sched_getaffinity(0)), "processor": platform.processor() or platform.machine(),
                    "roseinfer_amx": os.environ.get("ROSEINFER_AMX", "1")},
        "prompts": rows,
    }
    print(f"one prompt to its first token, {args.dtype} (ours: quantization {args.quantization}), "
          f"{result['machine']['cpus']} CPUs, best of {args.repeats}")
    for length, row in rows.items():
        print(f"{length:6d} tokens: roseinfer {min(row['roseinfer_s']):6.2f} s, transformers forward "
              f"{min(row['hf_forward_s']):6.2f} s: {row['hf_over_ours']:.2f}x")  # fmt: skip
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
