"""vLLM's server flags that have no setting of their own here, taken so that a vLLM command line runs as it is.

Each is one of three kinds, and its help says which: another name for one of our settings (folded into it by
`fold_into`), a value this server always runs with (any other value is refused at the command line, before anything
loads), or a flag that changes nothing here (the help says why). vLLM's flags that are settings of ours too
(`--max-model-len`, `--served-model-name`, ...) live in common/config.py under their own names.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from common.config import flag

# vLLM's CUDA graph modes: NONE runs every step eagerly; any other replays decode steps from graphs here
GRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
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
    optimization_level: int | None = flag(None, "vLLM's -O: 0 is --enforce-eager; 1 to 3, decode steps replay CUDA "
                                          "graphs (the default; nothing is compiled here)", choices=[0, 1, 2, 3],
                                          short=["-O"])  # fmt: skip
    compilation_config: str | None = flag(None, "vLLM's, JSON: \"cudagraph_mode\": \"NONE\" is --enforce-eager; "
                                          "its other keys (and a level alone, 0 to 3) tune torch.compile, which does "
                                          "not run here")  # fmt: skip
    # values this server always runs with
    load_format: str = flag("auto", "weights load from the model's safetensors or GGUF file (auto) only",
                            choices=["auto"])  # fmt: skip
    tokenizer_mode: str = flag("auto", "the model's fast tokenizer (auto) only", choices=["auto"])
    pipeline_parallel_size: int = flag(1, "one stage only: a model is split by --tensor-parallel-size",
                                       choices=[1])  # fmt: skip
    distributed_executor_backend: str | None = flag(None, "tensor-parallel workers are processes (mp); uni: the "
                                                    "same here", choices=["mp", "uni"])  # fmt: skip
    enable_chunked_prefill: bool = flag(True, "prompts are always chunked to fit the step budget; "
                                        "--no-enable-chunked-prefill is refused")  # fmt: skip
    preemption_mode: str | None = flag(None, "a preempted request is recomputed from its tokens (recompute) only",
                                       choices=["recompute"])  # fmt: skip
    api_server_count: int = flag(1, "one API process, beside the engine cores", choices=[1])
    lora_dtype: str = flag("auto", "LoRA adapters compute in the model's dtype (auto) only, or in float32 where the "
                           "CPU has no fast kernel for it", choices=["auto"])  # fmt: skip
    guided_decoding_backend: str = flag("auto", "grammars are compiled by xgrammar (auto) only",
                                        choices=["auto", "xgrammar"])  # fmt: skip
    chat_template_content_format: str = flag("auto", "chat templates get each message's content as one string "
                                             "(its text parts joined) only", choices=["auto", "string"])
    limit_mm_per_prompt: str | None = flag(None, "JSON, each modality's most items per prompt: 0 only, as this server "
                                           "takes text only")  # fmt: skip
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
    max_loras: int | None = flag(None, "any number of LoRA adapters run in one step here")
    max_cpu_loras: int | None = flag(None, "an adapter stays loaded until it is unloaded")
    max_seq_len_to_capture: int | None = flag(None, "CUDA graphs cover every context up to --max-model-len")
    disable_frontend_multiprocessing: bool = flag(False, "the engine core is always a process of its own")
    revision: str | None = flag(None, "nothing is downloaded here: the model is a local directory or GGUF file, "
                                "whose files are the revision served")  # fmt: skip
    tokenizer_revision: str | None = flag(None, "as --revision, for the tokenizer")
    code_revision: str | None = flag(None, "no code from a model's directory is ever run here")
    hf_token: str | None = flag(None, "nothing is downloaded here, so no token is needed", nargs="?", const="")


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
    if ns.limit_mm_per_prompt is not None and _limits(parser, ns.limit_mm_per_prompt):
        parser.error(f"--limit-mm-per-prompt {ns.limit_mm_per_prompt}: this server takes text only (0 items of any "
                     "modality)")  # fmt: skip
    if ns.optimization_level == 0:
        ns.enforce_eager = True
    if ns.compilation_config is not None and _graph_mode(parser, ns.compilation_config) == "NONE":
        ns.enforce_eager = True


def _limits(parser: argparse.ArgumentParser, text: str) -> bool:
    """Whether --limit-mm-per-prompt allows any item: a JSON object of modalities (vLLM's {"image": 0}) and counts,
    or of option objects holding one (its newer {"video": {"count": 1, ...}})."""
    limits = _json(parser, "--limit-mm-per-prompt", text)
    if not isinstance(limits, dict):
        parser.error("--limit-mm-per-prompt must be a JSON object")
    counts = [v.get("count", 1) if isinstance(v, dict) else v for v in limits.values()]
    return any(c != 0 for c in counts)


def _graph_mode(parser: argparse.ArgumentParser, text: str) -> str | None:
    """--compilation-config's cudagraph_mode (None: not given); anything but a JSON object is a usage error."""
    config = _json(parser, "--compilation-config", text)
    if type(config) is int and 0 <= config <= 3:  # vLLM's older form: a compilation level alone
        return None
    if not isinstance(config, dict):
        parser.error("--compilation-config must be a JSON object (or a level, 0 to 3)")
    mode = config.get("cudagraph_mode")
    if mode is not None and mode not in GRAPH_MODES:
        parser.error(f"--compilation-config: cudagraph_mode {mode!r} is not one of {', '.join(GRAPH_MODES)}")
    return mode


def _json(parser: argparse.ArgumentParser, flag_name: str, text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        parser.error(f"{flag_name} is not JSON: {exc}")


def _fold(parser: argparse.ArgumentParser, ns: argparse.Namespace, name: str, value: object, default: object,
          given_as: str) -> None:  # fmt: skip
    current = getattr(ns, name)
    if current not in (default, value):
        parser.error(f"{given_as} contradicts --{name.replace('_', '-')} {current}")
    setattr(ns, name, value)
