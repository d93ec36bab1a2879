"""python -m frontend.offline.generate --prompt TEXT: chat-templated generation from the command line."""

from __future__ import annotations

import argparse
import sys

from common.config import EngineConfig, add_cli_args, from_cli_args
from common.lora import lora_modules
from common.messages import SamplingParams
from common.model_source import ModelSourceError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m frontend.offline.generate")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--sample-seed", type=int, default=None, help="seed of this request's sampling")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--lora", default="", help="the adapter of --lora-modules that answers (with --enable-lora)")
    add_cli_args(parser, EngineConfig)
    args = parser.parse_args(argv)
    from frontend.offline.llm import LLM  # after parsing, so --help is instant

    config = from_cli_args(EngineConfig, args)
    options = {k: v for k, v in vars(config).items() if k != "model"}
    try:
        names = [m.name for m in lora_modules(config)]  # bad flags or adapter configs: before the engine starts
        if args.lora and args.lora not in names:
            raise ValueError(f"--lora {args.lora!r} is not an adapter of --lora-modules ({', '.join(names) or 'none'})")
        with LLM(config.model, **options) as llm:
            prompt = args.prompt if args.raw else llm.chat_prompt([{"role": "user", "content": args.prompt}])
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                    seed=args.sample_seed)  # fmt: skip
            (out,) = llm.generate([prompt], params, use_tqdm=False, lora=args.lora)
    except (ModelSourceError, RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(out.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
