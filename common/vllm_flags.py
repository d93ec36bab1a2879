"""vLLM's server flags that have no setting of their own here, taken so that a vLLM command line runs as it is.

Each is one of three kinds, and its help says which: another name for one of our settings (folded into it by
`fold_into`), a value this server always runs with (any other value is refused at the command line, before anything
loads), or a flag that changes nothing here (the help says why). vLLM's flags that are settings of ours too
(`--max-model-len`, `--served-model-name`, ...) live in common/config.py under their own names.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from common.config import flag

# --task's values (vLLM's older flag) -> --runner's
TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling",
                "classify": "pooling", "score": "pooling", "reward": "pooling"}  # fmt: skip


@dataclass
class VllmFlags:
    # other names for our settings
    task: str | None = flag(None, "vLLM's older name for --runner: generate, or embed, classify, score, reward "
                            "(pooling)", choices=sorted(TASK_RUNNERS))  # fmt: skip
    num_gpu_blocks_override: int | None = flag(None, "vLLM's name for --num-kv-blocks")
    async_scheduling: bool = flag(False, "vLLM's name for --overlap-decode on: the next step is scheduled while "
                                  "this one computes")  # fmt: skip
    disable_fastapi_docs: bool = flag(False, "no /docs, /redoc or /openapi.json (as without --enable-docs)")
    # values this server always runs with
    kv_cache_dtype: str = flag("auto", "the KV cache is kept in the model's dtype (auto) only", choices=["auto"])
    load_format: str = flag("auto", "weights load from the model's safetensors or GGUF file (auto) only",
                            choices=["auto"])  # fmt: skip
    tokenizer_mode: str = flag("auto", "the model's fast tokenizer (auto) only", choices=["auto"])
    pipeline_parallel_size: int = flag(1, "one stage only: a model is split by --tensor-parallel-size",
                                       choices=[1])  # fmt: skip
    distributed_executor_backend: str | None = flag(None, "tensor-parallel workers are processes (mp); uni: the "
                                                    "same here", choices=["mp", "uni"])  # fmt: skip
    enable_chunked_prefill: bool = flag(True, "prompts are always chunked to fit the step budget; "
                                        "--no-enable-chunked-prefill is refused")  # fmt: skip
    # flags that change nothing here
    trust_remote_code: bool = flag(False, "no code from a model's directory is ever run here (each architecture "
                                   "is our own implementation)")  # fmt: skip
    swap_space: float = flag(4.0, "a preempted request is recomputed from its tokens here, never swapped out to CPU "
                             "memory")  # fmt: skip
    download_dir: str | None = flag(None, "nothing is downloaded here: the model is a local directory or GGUF file")
    max_parallel_loading_workers: int | None = flag(None, "the weights load in one pass, a group of layers at a "
                                                    "time")  # fmt: skip
    disable_custom_all_reduce: bool = flag(False, "tensor parallelism sums with torch.distributed's all-reduce "
                                           "(NCCL's, gloo's); there is no custom one")  # fmt: skip
    enable_request_id_headers: bool = flag(False, "every response carries X-Request-Id (the request's own, or a "
                                           "new one)")  # fmt: skip


def fold_into(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Sets our settings that vLLM's other names stand for in the parsed flags `ns`; a contradiction (the same
    setting given two different values) or a refused value is a usage error."""
    if not ns.enable_chunked_prefill:  # a step budget smaller than a prompt always chunks it here
        parser.error("--no-enable-chunked-prefill: prompts are always chunked to fit --max-num-batched-tokens")
    if ns.task is not None:
        _fold(parser, ns, "runner", TASK_RUNNERS[ns.task], "auto", f"--task {ns.task}")
    if ns.num_gpu_blocks_override is not None:
        _fold(parser, ns, "num_kv_blocks", ns.num_gpu_blocks_override, None, "--num-gpu-blocks-override")
    if ns.async_scheduling:
        _fold(parser, ns, "overlap_decode", "on", "auto", "--async-scheduling")
    if ns.disable_fastapi_docs:
        _fold(parser, ns, "enable_docs", False, False, "--disable-fastapi-docs")


def _fold(parser: argparse.ArgumentParser, ns: argparse.Namespace, name: str, value: object, default: object,
          given_as: str) -> None:  # fmt: skip
    current = getattr(ns, name)
    if current not in (default, value):
        parser.error(f"{given_as} contradicts --{name.replace('_', '-')} {current}")
    setattr(ns, name, value)
