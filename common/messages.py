"""Every type that crosses the frontend <-> engine-core boundary, and nothing else."""

from __future__ import annotations

import enum

import msgspec


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


# Limits on SamplingParams that both sides enforce: the API refuses past them with a 400, the engine re-checks.
MAX_TOP_K = 2**31 - 1  # above the vocabulary means "off"; bounded so that no tensor build can overflow
MAX_LOGIT_BIAS = 1024  # entries (OpenAI allows about 300)
MAX_BAD_WORDS = 16  # bad_words per request; each becomes up to two token sequences
MAX_BAD_WORD_TOKENS = 2048  # tokens in one bad word's sequence (the API takes words of up to 256 characters)


class StructuredOutput(_Msg, frozen=True):
    """A constraint on the generated text; the engine compiles it (xgrammar) into a per-step token mask.

    kind: "json_object" (any JSON object), "json_schema" (spec = the schema as JSON text), "regex" (spec = the
    pattern), "choice" (spec = a JSON list of the allowed strings), "grammar" (spec = EBNF text) or "json_or_calls"
    (spec = JSON: the JSON of "schema", or tagged calls: "begin", JSON of "calls", "end", by "separator").

    A reasoning model's thinking is left free (--reasoning-parser): with `reasoning_end` (its </think> token) the
    grammar holds the answer only after that token; with `reasoning_start` (<think>) too, only when the answer opens
    with it, and from the first token otherwise.
    """

    kind: str
    spec: str = ""
    reasoning_start: int | None = None
    reasoning_end: int | None = None


class SamplingParams(_Msg, frozen=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-n alternatives besides the chosen token; 0 = chosen only
    logit_bias: dict[int, float] = {}  # token id -> bias added to its logit before sampling (OpenAI's)
    allowed_token_ids: list[int] = []  # vLLM's: only these may be sampled (empty: any)
    # vLLM's bad_words as token sequences: a sequence's last token is banned where the outputs end with the rest
    bad_words: list[list[int]] = []
    structured: StructuredOutput | None = None  # constrained decoding (response_format, guided_*, tool_choice)
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs with top-k alternatives; 0 = own only

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def openai(self) -> str:
        return {0: "stop", 1: "length", 2: "abort", 3: "error"}[int(self)]


# ---- frontend -> engine ----


class LoraRef(_Msg, frozen=True):
    """A LoRA adapter as the engine knows it: `id` is unique to one load of it for the server's life (the API
    numbers --lora-modules 1.. and each runtime load after them), so the prefix cache and the router never mix two
    versions under one name; `path` lets an engine that has not loaded it (restarted, or another data-parallel
    engine) load it on first use."""

    id: int
    name: str  # what requests name it by (`model`)
    path: str  # its PEFT directory


class EngineRequest(_Msg, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    priority: int = 0
    # Tokens already streamed to the client: a restarted engine resumes after them.
    output_token_ids: list[int] = []
    lora: LoraRef | None = None  # the LoRA adapter that serves it (None: the base model)
    cache_salt: str = ""  # vLLM's: its prefix-cache blocks are shared only with requests of the same salt
    # A pooling request (--runner pooling; params.max_tokens 0): what the model pools from the prompt's last
    # position comes back (an embedding model's hidden state, a classifier's label logits), no token.
    pool: bool = False


class AbortRequest(_Msg, tag="abort"):
    request_ids: list[str]


class UtilityCall(_Msg, tag="call"):
    call_id: int
    method: str  # "health" | "stats" | "reset_prefix_cache" | "load_lora" | "unload_lora" | "sleep" (debug)
    arg: float = 0.0
    lora: LoraRef | None = None  # of load_lora and unload_lora


EngineInput = EngineRequest | AbortRequest | UtilityCall


# ---- engine -> frontend ----


class Logprobs(_Msg):
    """Per new token: its logprob, and the top-n (token id, logprob) alternatives."""

    token_logprobs: list[float]
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    ranks: list[int] = []  # prompt logprobs only: each token's rank in its distribution (1 = the most likely)


class EngineOutput(_Msg):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_cached_tokens: int = 0
    new_logprobs: Logprobs | None = None
    error: str | None = None
    # With the request's first output when params.prompt_logprobs is set: one entry per prompt token after the
    # first (the first has no logprob), in prompt order.
    prompt_logprobs: Logprobs | None = None
    error_code: str | None = None  # why it failed, where the API answers other than "the engine failed"
    # A pooling request's result, little-endian float32: its prompt's last final-norm hidden state, or, from a
    # classifier, that state's label logits.
    pooled: bytes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(_Msg):
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preempted: int = 0
    step_time_s: float = 0.0  # last step: schedule + forward + sampling + update
    forward_time_s: float = 0.0  # of which the model forward and logits
    num_blocks_in_use: int = 0
    num_draft_tokens: int = 0  # speculative decoding, since the engine started: tokens proposed
    num_accepted_tokens: int = 0  # of which the model agreed with
    num_loras: int = 0  # LoRA adapters whose weights the engine holds


class EngineOutputs(_Msg, tag="out"):
    epoch: int
    outputs: list[EngineOutput]
    timestamp: float = 0.0
    stats: SchedulerStats | None = None


class UtilityResult(_Msg, tag="result"):
    call_id: int
    ok: bool = True
    stats: SchedulerStats | None = None
    error: str | None = None


class EngineReady(_Msg, tag="ready"):
    epoch: int
    model: str
    max_model_len: int
    block_size: int
    num_blocks: int
    vocab_size: int
    eos_token_ids: list[int] = []
    runner: str = "generate"  # or "pooling": it serves pooling requests only (common/pooling.py)


class EngineDead(_Msg, tag="dead"):
    epoch: int
    error: str


class EnginePulse(_Msg, tag="pulse"):
    """The step in progress is still moving (engine_core/pulse.py): a health check it holds up is not a hang."""

    epoch: int


class EngineStarted(_Msg, tag="started"):
    """A request this engine admits for the first time, sent before its first step runs: after a crash, the API
    blames only requests the engine had started, never those still queued (frontend/engine/request_stream.py)."""

    epoch: int
    request_id: str


EngineMessage = EngineOutputs | UtilityResult | EngineReady | EngineDead | EnginePulse | EngineStarted
