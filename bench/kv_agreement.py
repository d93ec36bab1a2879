"""How far engines of other settings follow the default engine's greedy tokens: --kv-cache-dtype fp8 beside two
changes whose drift is only rounding (attention through the torch reference instead of our kernels; float32).

Each engine runs in this process over the first --prompts chats of bench/data/conversations.jsonl (their system and
first user message, the default model's chat template), greedy, --tokens tokens each, prefix caching off. Prints,
for each setting, how many outputs are the default's token for token, and the mean count of tokens before the first
difference.

python -m bench.kv_agreement [--prompts 32 --tokens 64] [--result-json F]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from common.config import EngineConfig
from common.messages import EngineRequest, SamplingParams
from common.model_source import resolve_model
from engine_core.core import EngineCore
from frontend.text.tokenizer import Tokenizer

CHATS = Path(__file__).parent / "data" / "conversations.jsonl"
SETTINGS = {"default (bf16)": {}, "fp8 KV cache": {"kv_cache_dtype": "fp8"},
            "torch attention": {"attention_backend": "torch"}, "float32": {"dtype": "float32"}}  # fmt: skip


def greedy_tokens(config: EngineConfig, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt's `tokens` greedy tokens (EOS ignored), all requests at once through an in-process engine."""
    core = EngineCore(config)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineRequest(str(i), prompt, params))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_work:
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    return list(out.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--result-json")
    args = parser.parse_args()
    source = resolve_model(None)
    tokenizer = Tokenizer(source.tokenizer)
    chats = [d["messages"] for d in map(json.loads, CHATS.open()) if "messages" in d]
    prompts = [tokenizer.encode_chat(m[:2] if m[0]["role"] == "system" else m[:1], add_generation_prompt=True)
               for m in chats][: args.prompts]  # fmt: skip
    outputs, results = {}, {}
    for name, overrides in SETTINGS.items():
        base = {"model": source.path, "dtype": "bfloat16", "enable_prefix_caching": False}
        outputs[name] = greedy_tokens(EngineConfig(**{**base, **overrides}), prompts, args.tokens)
        default = outputs["default (bf16)"]
        kept = [next((j for j, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), args.tokens)
                for x, y in zip(outputs[name], default, strict=True)]  # fmt: skip
        results[name] = {"identical": sum(k == args.tokens for k in kept), "mean_tokens_kept": sum(kept) / len(kept)}
        print(f"{name}: {results[name]['identical']} of {len(kept)} outputs the default's token for token; "
              f"{results[name]['mean_tokens_kept']:.1f} tokens kept on average", flush=True)  # fmt: skip
    if args.result_json:
        machine = {"processor": platform.processor() or platform.machine()}
        settings = {"prompts": args.prompts, "tokens": args.tokens, "model": "SmolLM2-135M-Instruct", "greedy": True}
        with open(args.result_json, "w") as f:
            json.dump({"machine": machine, "settings": settings, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
