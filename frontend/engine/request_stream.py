"""RequestStream: one engine request's state in the frontend (prompt, streamed ids, text) and its single delta slot."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from common.messages import EngineOutput, EngineRequest, FinishReason, Logprobs
from frontend.engine.stream_pacing import StreamPacing
from frontend.text.detokenizer import IncrementalDetokenizer


@dataclass
class Delta:
    """What a consumer has not seen yet. Deltas merge while it lags, so each stream holds at most one."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None
    error_code: str | None = None  # why it failed, when that is more than "the engine failed"
    prompt_logprobs: Logprobs | None = None  # with the first delta, when asked for
    pooled: bytes | None = None  # a pooling request's result, with its last delta (EngineOutput.pooled)

    def merge(self, other: Delta) -> None:
        self.token_ids += other.token_ids
        self.text += other.text
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs
        self.finish_reason = other.finish_reason or self.finish_reason
        self.stop_reason = other.stop_reason if other.stop_reason is not None else self.stop_reason
        self.error = other.error or self.error
        self.error_code = other.error_code or self.error_code
        if self.prompt_logprobs is None:
            self.prompt_logprobs = other.prompt_logprobs
        self.pooled = other.pooled or self.pooled


class RequestStream:
    """Owned by the client's output task (the writer) and one consumer (async iteration)."""

    def __init__(self, request: EngineRequest, detokenizer: IncrementalDetokenizer | None,
                 include_stop_token: bool = False, pacing: StreamPacing | None = None) -> None:  # fmt: skip
        self.request = request
        self.detokenizer = detokenizer
        self.include_stop_token = include_stop_token
        self.output_token_ids: list[int] = []  # what was streamed: a restarted engine resumes after it
        self.num_cached_tokens = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it failed (finish_reason "error")
        self.on_finish: Callable[[RequestStream], None] | None = None  # --enable-log-outputs' line
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.sent_at: int | None = None  # len(output_token_ids) when last sent to an engine; None: in none
        self.suspect = False  # implicated in the last engine crash
        self.started = False  # the engine it was last sent to has admitted it into a step (EngineStarted)
        self.prompt_logprobs_seen = False  # a resumed request's engine sends none; at most once either way
        self.pacing = pacing  # None: the consumer is woken for every output
        self.hold_to_end = False  # a consumer that only wants the whole result (non-streaming) is woken once
        self._slot: Delta | None = None
        self._ready = asyncio.Event()  # set: the slot goes to the consumer now
        self._held_since = 0.0  # when the slot's oldest part arrived
        self._gap = 0.0  # between the last two tokens: when the next one is expected
        self._timer: asyncio.TimerHandle | None = None  # wakes the consumer when a held slot is max_hold_s old
        self._started = False  # the consumer took a delta already

    @property
    def request_id(self) -> str:
        return self.request.request_id

    # ---- writer side (the client's output task) ----

    def on_output(self, out: EngineOutput) -> bool:
        """Applies one engine output. Returns True when the frontend ended the request itself (stop string)."""
        if self.finished:
            return False
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        delta = Delta()
        if out.prompt_logprobs is not None and not self.prompt_logprobs_seen:
            delta.prompt_logprobs, self.prompt_logprobs_seen = out.prompt_logprobs, True
        delta.pooled = out.pooled
        ids = out.new_token_ids
        for i, token in enumerate(ids):
            self.output_token_ids.append(token)
            delta.token_ids.append(token)
            if out.new_logprobs is not None and i < len(out.new_logprobs.token_logprobs):
                self._add_logprobs(delta, out.new_logprobs, i)
            if self.detokenizer is None:
                continue
            is_stop_token = out.stop_token_id is not None and i == len(ids) - 1
            if not is_stop_token or self.include_stop_token:
                delta.text += self.detokenizer.add(token)
            if self.detokenizer.stopped:  # tokens after the stop string are dropped
                delta.finish_reason, delta.stop_reason = "stop", self.detokenizer.stop_reason
                break
        if delta.finish_reason is None and out.finish_reason is not None:
            if self.detokenizer is not None:
                delta.text += self.detokenizer.finish()
            delta.finish_reason = "error" if out.finish_reason == FinishReason.ERROR else out.finish_reason.openai()
            # The id only when it was one of the request's stop_token_ids: EOS ends it with stop_reason null (vLLM).
            stop_ids = self.request.params.stop_token_ids
            delta.stop_reason = out.stop_token_id if out.stop_token_id in stop_ids else None
            delta.error, delta.error_code = out.error, out.error_code
        self._put(delta)
        return delta.finish_reason is not None and out.finish_reason is None

    @staticmethod
    def _add_logprobs(delta: Delta, lp: Logprobs, i: int) -> None:
        delta.logprobs.append(lp.token_logprobs[i])
        delta.top_ids.append(lp.top_ids[i] if i < len(lp.top_ids) else [])
        delta.top_logprobs.append(lp.top_logprobs[i] if i < len(lp.top_logprobs) else [])

    def fail(self, error: str, code: str | None = None) -> None:
        if not self.finished:
            self._put(Delta(finish_reason="error", error=error, error_code=code))

    # ---- engine restarts (the client) ----

    def mark_sent(self) -> EngineRequest:
        """The request to (re)send. After a restart it carries the tokens already streamed, after which the
        engine continues exactly (max_tokens stays the total: the engine counts them)."""
        self.sent_at, self.started = len(self.output_token_ids), False
        if not self.output_token_ids:
            return self.request
        return msgspec.structs.replace(self.request, output_token_ids=list(self.output_token_ids))

    def on_crash(self) -> bool:
        """Records an engine crash; True when this request is implicated in two crashes running (poison).
        Implicated: started by the engine, and no token since it was sent. One that made progress did not crash
        the engine on sight, one still queued never ran, and blaming every bystander would fail all in-flight
        requests after any two crashes (the OOM killer twice under load)."""
        implicated = self.started and self.sent_at is not None and len(self.output_token_ids) == self.sent_at
        poison = implicated and self.suspect
        self.suspect, self.sent_at = implicated, None
        return poison

    def _put(self, delta: Delta) -> None:
        now = time.monotonic()
        if delta.token_ids:
            self.first_token_time = self.first_token_time or now
            if self.last_token_time is not None:
                self._gap = now - self.last_token_time
            self.last_token_time = now
        if delta.finish_reason is not None:
            self.finished = True
            self.finish_reason, self.error = delta.finish_reason, delta.error
            if self.on_finish is not None:
                self.on_finish(self)
        if self._slot is None:
            self._slot, self._held_since = delta, now
        else:
            self._slot.merge(delta)
        if self._due(self._slot, now):
            self._wake()
        elif self._timer is None and self.pacing is not None and not self.hold_to_end:
            # Only a stream whose next token is late (preempted, a long step) gets here: wake it at the deadline.
            wait = self._held_since + self.pacing.max_hold_s - now
            self._timer = asyncio.get_running_loop().call_later(wait, self._wake)

    def _due(self, slot: Delta, now: float) -> bool:
        """Whether the consumer takes the slot now or lets it gather more (StreamPacing)."""
        if slot.finish_reason is not None:
            return True
        if self.hold_to_end:
            return False
        if self.pacing is None or not self._started:  # the first output goes at once: time to first token
            return True
        per_wakeup = self.pacing.tokens_per_wakeup()
        # Held only while the next token, at the last gap between tokens, still comes before max_hold_s: slow steps
        # (a busy machine) send each token at once rather than late.
        return (per_wakeup <= 1 or len(slot.token_ids) >= per_wakeup
                or now - self._held_since + self._gap > self.pacing.max_hold_s)  # fmt: skip

    def _wake(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._slot is not None:
            self._ready.set()

    # ---- consumer side ----

    async def get(self) -> Delta:
        """The next merged delta; the last one has finish_reason set. Raises StopAsyncIteration after it."""
        while self._slot is None or not self._ready.is_set():
            if self._slot is None and self.finished:
                raise StopAsyncIteration
            await self._ready.wait()
        delta, self._slot, self._started = self._slot, None, True
        self._ready.clear()
        return delta

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        return await self.get()
