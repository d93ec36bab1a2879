"""Correctness on a GPU with CUDA graphs on, for a model directory (e.g. a random-weight one from
bench/make_random_model.py, so no hub and no GGUF are needed):

- greedy: our engine against HF transformers' `generate` (one prompt at a time, no padding), token for token; a
  divergence is reported with HF's top-2 logit gap there (a near-tie flips on any change of summation order);
- seeded sampling: one seeded request alone, then the same request inside batches of other requests: its tokens
  must not change with the batch.

python -m bench.gpu_parity --model DIR [--dtype float32] [--result-json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.offline import random_prompts
from common.config import EngineConfig
from common.messages import EngineRequest, SamplingParams
from frontend.offline.engine_link import EngineClient

LENGTHS = [1, 7, 16, 33, 64, 100, 129, 200, 255, 300, 400, 517]


def collect(engine: EngineClient, requests: list[EngineRequest]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.send(r)
    done = 0
    while done < len(requests):
        for out in engine.next_outputs(timeout=600).outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            done += out.finished
    return tokens


def hf_greedy(model_dir: str, dtype: torch.dtype, device: str, prompts: list[list[int]], max_new: int) -> list[tuple]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    results = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p], device=device), max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=0)  # fmt: skip
            gaps = [float(top[0] - top[1]) for top in (s[0].topk(2).values for s in out.scores)]
            results.append((out.sequences[0, len(p) :].tolist(), gaps))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    prompts = [random_prompts(1, n, seed=100 + n)[0] for n in LENGTHS]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=64, max_model_len=1024,
                          gpu_memory_utilization=0.5)  # graphs on: the default  # fmt: skip
    with EngineClient(config) as engine:
        ours = collect(engine, [EngineRequest(f"g{i}", p, greedy) for i, p in enumerate(prompts)])
        alone = collect(engine, [EngineRequest("alone", prompts[3], seeded)])["alone"]
        in_batches = []
        for size in (3, 17, 40):
            others = [EngineRequest(f"b{size}-{i}", p, seeded) for i, p in enumerate(random_prompts(size, 50, size))]
            batch = collect(engine, [*others[: size // 2], EngineRequest(f"s{size}", prompts[3], seeded),
                                     *others[size // 2 :]])  # fmt: skip
            in_batches.append(batch[f"s{size}"])
    refs = hf_greedy(args.model, getattr(torch, args.dtype), args.device, prompts, args.max_tokens)
    rows = []
    for i, (n, (ref, gaps)) in enumerate(zip(LENGTHS, refs, strict=True)):
        mine = ours[f"g{i}"]
        at = next((j for j, (a, b) in enumerate(zip(mine, ref, strict=True)) if a != b), None)
        rows.append({"prompt_len": n, "equal": at is None, "diverges_at": at,
                     "hf_top2_gap_there": gaps[at] if at is not None else None})  # fmt: skip
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    result = {"model": args.model, "dtype": args.dtype, "gpu": gpu,
              "greedy_equal": sum(r["equal"] for r in rows), "greedy_prompts": len(rows), "greedy": rows,
              "seeded_identical_in_batches_of_3_17_40": all(t == alone for t in in_batches)}  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
