"""Request and RequestStatus: one request's tokens, progress, and KV blocks inside the engine core."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import numpy as np

from common.messages import EngineRequest, FinishReason, SamplingParams
from engine_core.prompt_logprobs import PromptLogprobs, new_accumulator

if TYPE_CHECKING:
    from engine_core.speculative import NgramIndex
    from engine_core.structured import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Request:
    __slots__ = (
        "request_id", "params", "token_ids", "num_prompt_tokens", "eos_token_ids", "arrival_time",
        "priority", "num_computed_tokens", "num_cached_tokens", "block_ids", "block_hashes", "status",
        "finish_reason", "stop_token_id", "error", "num_preemptions", "seq_no", "num_registered_blocks",
        "prompt_logprobs", "grammar", "draft_token_ids", "ngram_index", "_ids_array", "_ids_filled", "lora_slot",
        "cache_salt", "pool", "pooled",
    )  # fmt: skip

    def __init__(self, msg: EngineRequest, seq_no: int) -> None:
        self.request_id = msg.request_id
        self.params: SamplingParams = msg.params
        # Prompt and outputs in one list; a resumed request arrives with the outputs it already streamed.
        self.token_ids: list[int] = list(msg.prompt_token_ids) + list(msg.output_token_ids)
        self.num_prompt_tokens = len(msg.prompt_token_ids)
        self.eos_token_ids = frozenset(msg.eos_token_ids)
        self.arrival_time = msg.arrival_time
        self.priority = msg.priority
        self.lora_slot = 0  # the LoRA adapter serving it (engine_core/lora.py), set when admitted; 0: none
        self.cache_salt = msg.cache_salt  # its prefix-cache blocks are another request's only under the same salt
        self.pool = msg.pool  # pooling: what its last prompt position pools to is the result, not a token
        self.pooled: bytes | None = None  # that result, set by the runner's step over the position
        self.seq_no = seq_no  # admission order: the tie-breaker of every policy
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens that came from the prefix cache (the most at any admission)
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hash of each full block: its tokens and kernel role (kv_cache)
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_token_id: int | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.grammar: RequestGrammar | None = None  # constrained decoding (engine_core/structured.py)
        self.draft_token_ids: list[int] = []  # this step's speculative tokens (engine_core/speculative.py)
        self.ngram_index: NgramIndex | None = None  # built on its first draft
        self._ids_array: np.ndarray | None = None  # token_array's buffer, its first _ids_filled entries set
        self._ids_filled = 0
        # Filled during prefill when params.prompt_logprobs is set; None once sent with the first output.
        self.prompt_logprobs: PromptLogprobs | None = new_accumulator(msg.params.prompt_logprobs,
                                                                      bool(msg.output_token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def token_array(self) -> np.ndarray:
        """token_ids as int64, kept in a buffer that only takes the tokens appended since the last call (token_ids
        only grows): the penalties read every token of a request each step, a list conversion of all of them."""
        n = len(self.token_ids)
        if self._ids_array is None or len(self._ids_array) < n:
            self._ids_array, self._ids_filled = np.empty(max(2 * n, 64), dtype=np.int64), 0
        if self._ids_filled < n:
            self._ids_array[self._ids_filled : n] = self.token_ids[self._ids_filled :]
            self._ids_filled = n
        return self._ids_array[:n]

    @property
    def decoding(self) -> bool:
        """Whether its next positions are outputs, which run as decode rows (each attending to the keys up to its own
        position), where prompt positions run as prefill chunks, even the lone last one that a prefix-cache hit
        leaves. So each position is computed by the same kernel in its first decode and when a preemption or an
        engine restart recomputes it, whatever the prefix cache held: the decode and prefill kernels round
        differently, and a recomputed stream must go on exactly as it would have."""
        return self.num_computed_tokens >= self.num_prompt_tokens

    def next_chunk(self, budget: int, computed: int) -> int:
        """How many tokens to compute next, from `computed` on, at most budget: the rest of the prompt, then the
        rest of the outputs (a recompute), never both at once (they run through other kernels: `decoding`)."""
        end = self.num_prompt_tokens if computed < self.num_prompt_tokens else self.num_tokens
        return min(end - computed, budget)

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def check_stop(self, max_model_len: int) -> FinishReason | None:
        """Called after a token was appended: EOS / stop ids (after min_tokens), then length limits."""
        p = self.params
        last = self.token_ids[-1]
        if self.num_output_tokens >= p.min_tokens and (
            (not p.ignore_eos and last in self.eos_token_ids) or last in p.stop_token_ids
        ):
            self.stop_token_id = last
            return FinishReason.STOP
        if self.num_output_tokens >= p.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
