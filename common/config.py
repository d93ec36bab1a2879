"""EngineConfig and ServerConfig: the one place each command-line flag is defined."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")
# What sampled logprobs report (vLLM's --logprobs-mode; engine_core/sampler.py computes them)
LOGPROBS_MODES = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs


def flag(default: Any, help: str, **kw: Any) -> Any:
    if default is list:
        return field(default_factory=list, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineConfig:
    model: str | None = flag(None, "HF model dir, .gguf file, or empty for the default SmolLM2-135M-Instruct")
    dtype: str = flag("auto", "auto | float32 (float) | bfloat16 | float16 (half), vLLM's names (auto: bf16 on CUDA, "
                      "AVX512-BF16 or AVX2 CPUs)", choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    runner: str = flag(
        "auto", "auto | generate | pooling (vLLM's): pooling serves embeddings and scores, not generation (auto: "
        "pooling for a sentence-transformers directory, a classifier or a checkpoint without an LM head, such as "
        "Qwen3Model)",
        choices=["auto", "generate", "pooling"],
    )
    tokenizer: str | None = flag(None, "a local directory whose tokenizer (tokenizer.json, tokenizer_config.json, chat "
                                 "template) is used instead of the model's (vLLM's --tokenizer, as for a GGUF)")
    hf_overrides: str | None = flag(
        None, "JSON laid over the model's config.json (vLLM's), such as Qwen3-Reranker's '{\"architectures\": "
        "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"], "
        "\"is_original_qwen3_reranker\": true}'",
    )
    quantization: str = flag(
        "none", "none | int8 | int4: weight-only int8 or int4 linears, the LM head int8 (CPU bf16, AVX512-BF16 or "
        "AVX2; faster at small batches; int4 fastest, least exact). A GPTQ, AWQ or compressed-tensors W4A16 "
        "checkpoint is served on the int4 grid as it is, without the flag (vLLM's gptq, awq, gptq_marlin, "
        "awq_marlin and compressed-tensors name it too)",
        choices=["none", "int8", "int4", "gptq", "awq", "gptq_marlin", "awq_marlin", "compressed-tensors"],
    )
    device: str = flag("auto", "auto | cpu | cuda")
    max_model_len: int | None = flag(None, "context length (default: the model's, capped at 8192)")
    block_size: int = flag(16, "tokens per KV cache block")
    kv_cache_memory: float = flag(2.0, "GiB of KV cache on CPU (the whole tensor-parallel group's)")
    kv_cache_dtype: str = flag("auto", "auto: K/V kept in the model's dtype; fp8 (or fp8_e4m3): in float8 e4m3, half "
                               "the memory of bf16, so twice the tokens, a little less exact (CPU, bf16 models; "
                               "fp8_e5m2 is not taken)", choices=["auto", "fp8", "fp8_e4m3"])  # fmt: skip
    gpu_memory_utilization: float = flag(0.9, "CUDA: share of the GPU's total memory for this engine (weights, "
                                         "activations, CUDA graphs, KV cache: sized by a profiling step)")
    num_kv_blocks: int | None = flag(None, "exact number of KV blocks (overrides the memory sizing)")
    max_num_seqs: int = flag(128, "most requests running in one step")
    max_num_batched_tokens: int | None = flag(
        None, "token budget of one step, prefill chunked to fit (default, as vLLM's server: 8192 on a GPU of 70 GiB or "
        "more other than an A100, else 2048)",
    )
    enable_prefix_caching: bool = flag(True, "reuse KV blocks of shared prompt prefixes")
    scheduling_policy: str = flag("fcfs", "fcfs | priority | round-robin", choices=["fcfs", "priority", "round-robin"])
    num_threads: int | None = flag(None, "torch CPU threads (default: the cores this process may use)")
    enforce_eager: bool = flag(False, "never capture CUDA graphs")
    mixed_step_graphs: bool = flag(False, "CUDA: a step with prompt tokens that fits the largest graph (up to 1024 "
                                   "tokens) replays one, its prompt tokens as decode rows, instead of running eagerly "
                                   "(off: slower than eager in the one H100 serving run that compared them)")
    overlap_decode: str = flag(
        "auto", "auto | on | off: launch the next decode step before reading the last one's tokens back, so that the "
        "host's bookkeeping runs while the GPU computes (auto: on CUDA)", choices=["auto", "on", "off"],
    )
    attention_backend: str = flag(
        "auto", "auto | torch | cpu | triton (auto: ROSEINFER_ATTENTION_BACKEND if set, else triton on CUDA, "
        "the C kernels on CPU when they take the model, else torch)", choices=["auto", "torch", "cpu", "triton"],
    )
    speculative_config: str | None = flag(
        None, 'JSON, as vLLM\'s: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2, "disable_by_batch_size": null, "max_rows_per_step": 16}: draft tokens copied from the '
        "request's own prompt and output, verified in one step (see README)",
    )
    enable_lora: bool = flag(False, "serve LoRA adapters (--lora-modules) beside the base model")
    lora_modules: list[str] = flag(
        list, 'LoRA adapters (PEFT directories) to serve, each name=path or JSON {"name": ..., "path": ...}: a '
        "request whose `model` is that name is served by the base model with the adapter", nargs="*",
    )
    max_lora_rank: int = flag(16, "largest LoRA rank an adapter may have")
    max_logprobs: int = flag(DEFAULT_MAX_LOGPROBS, "most logprobs (top alternatives per token, sampled or prompt) "
                             "a request may ask for, as vLLM's; -1: the whole vocabulary")  # fmt: skip
    logprobs_mode: str = flag("raw_logprobs", "what sampled logprobs report (vLLM's): the model's distribution (raw) "
                              "or the one each token was drawn from, after penalties, biases, temperature and top-k/p "
                              "(processed); as logprobs or logits", choices=LOGPROBS_MODES)  # fmt: skip
    seed: int = flag(0, "seed for requests that give none")
    epoch: int = flag(0, "restart generation of this engine (set by launch.py)")
    engine_index: int = flag(0, "identity of this engine on the input socket")
    tensor_parallel_size: int = flag(1, "ranks that split each layer (gloo on CPU, NCCL on CUDA); rank 0 schedules")
    nnodes: int = flag(1, "machines the tensor-parallel group spans (ranks split evenly over them)")
    node_rank: int = flag(0, "this machine's index: 0 runs the API and rank 0; others run only their workers")
    master_addr: str = flag("127.0.0.1", "address of node 0, where the group's rendezvous store listens")
    master_port: int | None = flag(None, "rendezvous port on node 0 (required with --nnodes > 1; default: a free one)")

    def logprobs_limit(self, vocab_size: int) -> int:
        """The most logprobs a request may ask for on a model with this vocabulary (--max-logprobs)."""
        check_max_logprobs(self.max_logprobs)
        return vocab_size if self.max_logprobs == -1 else min(self.max_logprobs, vocab_size)


def check_max_logprobs(value: int) -> None:
    if value < -1:
        raise ValueError(f"--max-logprobs must be -1 (the whole vocabulary) or at least 0, not {value}")


@dataclass
class ServerConfig:
    host: str = flag("127.0.0.1", "address the HTTP server binds")
    port: int = flag(8000, "HTTP port")
    served_model_name: list[str] = flag(list, "model name(s) in the API, as vLLM's: a request may name any of them, "
                                        "responses and metrics name the first (default: the model's name)", nargs="+")
    api_key: str | None = flag(None, "require 'Authorization: Bearer KEY' on every route but /health, /ping and "
                               "/metrics (default: $ROSEINFER_API_KEY, else $VLLM_API_KEY, which ps does not show)")
    api_key_on_health: bool = flag(False, "with --api-key: also require the key on /health, /ping and /metrics")
    enable_docs: bool = flag(False, "serve /docs, /redoc and /openapi.json (behind --api-key when set)")
    metrics_prefix: str = flag("roseinfer", "prefix of the Prometheus metrics' names: vllm gives vLLM's names, for "
                               "dashboards, autoscalers and inference gateways set up for vLLM",
                               choices=["roseinfer", "vllm"])  # fmt: skip
    allowed_origins: list[str] = flag(list, "CORS origins allowed (none by default)", nargs="*")
    allowed_methods: list[str] = flag(list, "CORS methods allowed to those origins (default: all)", nargs="*")
    allowed_headers: list[str] = flag(list, "CORS request headers allowed to those origins (default: all)", nargs="*")
    allow_credentials: bool = flag(False, "CORS: let those origins' browsers send cookies and credentials")
    max_queued_requests: int = flag(1024, "requests waiting or running beyond which new ones get 429")
    max_request_bytes: int = flag(8 << 20, "largest request body accepted; larger ones get 413 before parsing")
    max_connections: int = flag(1024, "open HTTP connections beyond which new requests get 503")
    header_timeout: float = flag(10.0, "seconds a client may take to send a request's headers")
    body_timeout: float = flag(30.0, "seconds a client may take to send a request's body")
    parse_special_tokens_in_content: bool = flag(
        False, "read special tokens written inside chat message content as control tokens (unsafe: prompt injection)"
    )
    chat_template: str | None = flag(
        None, "path to a Jinja chat template used instead of the model's own (on a pooling server: how /score and "
        "/rerank render a pair, such as examples/qwen3_reranker.jinja)",
    )
    generation_config: str = flag(
        "auto", "sampling defaults for what requests leave out: auto (the model's generation_config.json: temperature, "
        "top_p, top_k, min_p, repetition_penalty; its max_new_tokens caps every request), vllm (none), or a folder",
    )
    override_generation_config: str | None = flag(
        None, 'JSON laid over those defaults, in generation_config.json\'s names: \'{"temperature": 0.6}\'')
    responses_store_mib: int = flag(256, "MiB of stored responses (store: true; previous_response_id, GET), and as "
                                    "much of conversations, kept in memory, least recently used out first (0: none)")
    tool_call_parser: str | None = flag(
        None, "read tool calls in the model's own format for tool_choice auto (hermes: <tool_call>{...}</tool_call>, "
        "Qwen2.5 and Hermes models; llama3_json: {\"name\": ..., \"parameters\": {...}}, Llama 3.1-3.3; pythonic: "
        "[f(a=1), g()], Llama 4 and Llama 3.2 under vLLM's pythonic template; mistral: [TOOL_CALLS] then a JSON "
        "list of calls or name[ARGS]{...}, Mistral's models; functiongemma: <start_function_call>call:f{...}"
        "<end_function_call>, FunctionGemma; granite: <|tool_call|> then a JSON list of calls, Granite 3; qwen3_coder: "
        "<tool_call><function=f><parameter=p>value</parameter></function></tool_call>, Qwen3-Coder)",
        choices=["hermes", "llama3_json", "pythonic", "mistral", "functiongemma", "granite", "qwen3_coder"],
    )
    reasoning_parser: str | None = flag(
        None, "return a thinking model's <think> part of chat answers as `reasoning` (vLLM's field): qwen3 (Qwen3's "
        "hybrid models), deepseek_r1 (DeepSeek-R1 and its distills, QwQ, Qwen3's Thinking models)",
        choices=["deepseek_r1", "qwen3"],
    )
    enable_auto_tool_choice: bool = flag(
        False, "vLLM's switch for tool_choice auto, taken so that its command lines run: here --tool-call-parser "
        "alone turns calls in the model's format on (this flag needs one)",
    )
    stream_merge_above: int = flag(16, "streams in flight up to which every token is its own SSE event; above, an "
                                   "event carries up to ceil(streams / N) tokens (fewer events: less CPU per token)")
    stream_max_hold: float = flag(0.5, "seconds a streamed token may wait to go out with later ones (above)")
    engine_ready_timeout: float = flag(600.0, "seconds to wait for the engine core to start")
    engine_ping_timeout: float = flag(30.0, "seconds without an answer or a pulse before the engine counts as hung")
    drain_timeout: float = flag(30.0, "seconds in-flight requests may run on after SIGINT/SIGTERM")
    max_engine_restarts: int = flag(5, "engine restarts allowed within --engine-restart-window")
    engine_restart_window: float = flag(600.0, "seconds over which engine restarts are counted")
    engine_restart_timeout: float = flag(60.0, "seconds a new request waits for a restarting engine")
    engine_spare: bool = flag(True, "keep a spare engine process, its imports done and the model's config read, that "
                              "a restart starts from: the engine is back seconds sooner (not with tensor parallel)")
    data_parallel_size: int = flag(1, "engine cores, each with its own KV cache and share of the cores (or GPU)")
    log_level: str = flag("info", "warning hides the access log", choices=["error", "warning", "info", "debug"])
    # vLLM's logging, HTTP and compatibility flags, so that its command lines run here
    disable_log_stats: bool = flag(False, "no periodic stats line (throughput, running and waiting requests, KV cache "
                                   "usage, prefix cache hit rate: every 10 s at INFO while an engine has work)")
    enable_log_requests: bool = flag(False, "log each request at INFO: its prompt (text and token ids) and the "
                                     "sampling parameters it sets (prompts are users' data: off by default)")
    disable_log_requests: bool = flag(False, "vLLM's older flag: turns --enable-log-requests off (off by default)")
    enable_log_outputs: bool = flag(False, "log each generation as it ends, at INFO: its text and token ids and why it "
                                    "ended (users' data: off by default)")  # fmt: skip
    max_log_len: int | None = flag(None, "characters of text and ids of tokens a prompt's or output's log line shows "
                                   "(default: all)")
    uvicorn_log_level: str | None = flag(None, "uvicorn's log level (default: --log-level)",
                                         choices=["critical", "error", "warning", "info", "debug", "trace"])
    disable_uvicorn_access_log: bool = flag(False, "no access log line per HTTP request")
    root_path: str = flag("", "the path prefix a proxy in front strips (FastAPI's root_path: the URLs the API writes)")
    ssl_keyfile: str | None = flag(None, "serve HTTPS: the private key's PEM file (with --ssl-certfile)")
    ssl_certfile: str | None = flag(None, "serve HTTPS: the certificate chain's PEM file")
    ssl_ca_certs: str | None = flag(None, "CA certificates that client certificates are checked against")
    ssl_cert_reqs: int = flag(0, "client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*)",
                              choices=[0, 1, 2])
    return_tokens_as_token_ids: bool = flag(False, "logprobs name each token \"token_id:{id}\" rather than its text, "
                                            "unless a request sends return_tokens_as_token_ids false (vLLM's)")
    enable_prompt_tokens_details: bool = flag(False, "chat and completions usage gives prompt_tokens_details."
                                              "cached_tokens, the prompt tokens the prefix cache held (as OpenAI's)")


def _base_type(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_cli_args(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        help_text = meta.pop("help", "")
        names = [*meta.pop("short", []), name]  # such as vLLM's -O
        tp = _base_type(hints[f.name])
        if tp is bool:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif get_origin(tp) is list:
            parser.add_argument(*names, type=get_args(tp)[0], default=[], help=help_text, **meta)
        else:
            parser.add_argument(*names, type=tp, default=f.default, help=help_text, **meta)


def from_cli_args(cls: type[T], ns: argparse.Namespace) -> T:
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})  # type: ignore[call-arg]


def to_cli_args(cfg: Any) -> list[str]:
    """The flags that reproduce `cfg` (launch.py passes the engine's config to its child process)."""
    args: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        name = "--" + f.name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            args.append(name if value else "--no-" + name[2:])
        elif isinstance(value, list):
            args += [name, *map(str, value)] if value else []
        else:
            args += [name, str(value)]
    return args


MAX_SPECULATIVE_TOKENS = 16
DEFAULT_MAX_ROWS_PER_STEP = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """N-gram speculation (prompt lookup): after the last n tokens (n from max down to min) recur earlier in the
    request, the tokens that followed them there are proposed as the next ones."""

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None  # no drafts while more requests than this run
    # Ours: a step's running requests plus its draft rows stay within this. A small batch's step costs about the
    # same up to some number of rows (reading the weights bounds it); past that, rows cost arithmetic.
    max_rows_per_step: int = DEFAULT_MAX_ROWS_PER_STEP

    @staticmethod
    def parse(text: str | None) -> SpeculativeConfig | None:
        """None when off; ValueError naming the problem for anything we cannot run."""
        if text is None:
            return None
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(spec, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
                 "max_rows_per_step"}
        if unknown := sorted(set(spec) - known):
            raise ValueError(f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}")
        if spec.get("method", "ngram") != "ngram":
            raise ValueError(f"--speculative-config: method {spec['method']!r} is not supported (only \"ngram\")")
        k = spec.get("num_speculative_tokens")
        high = spec.get("prompt_lookup_max", spec.get("prompt_lookup_min", 4))
        low = spec.get("prompt_lookup_min", min(2, high) if isinstance(high, int) else 2)
        limit = spec.get("disable_by_batch_size")
        ints = {"num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}
        for name, value in ints.items():
            if type(value) is not int or not 1 <= value <= MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"--speculative-config: {name} must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        if low > high:
            raise ValueError("--speculative-config: prompt_lookup_min must not exceed prompt_lookup_max")
        rows = spec.get("max_rows_per_step", DEFAULT_MAX_ROWS_PER_STEP)
        for name, value in (("disable_by_batch_size", limit), ("max_rows_per_step", rows)):
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"--speculative-config: {name} must be a positive integer")
        return SpeculativeConfig(k, low, high, limit, rows)
