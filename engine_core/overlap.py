"""Overlapped decode: the host schedules and launches decode step N+1 before it reads step N's tokens back, and does
step N's bookkeeping (stop checks, outputs, freeing) while the GPU runs N+1. A synchronous step leaves the GPU idle
while the host works, which at a 1B model's batch of 256 was half of every step.

Step N+1 holds the requests of step N that may go on, each one position further: its input token is the one step N
sampled, taken on the device (ModelRunner.launch), its KV slot allocated ahead. A request that step N finishes (an
EOS, an abort) has a row in N+1 whose token is dropped (its update skips finished requests) and whose KV write
lands past its last registered block, in blocks it no longer holds: any later holder's writes queue after it on the
stream. Requests known to end with the token in flight (their max_tokens or the context length) get no row.

Step N+1 also admits waiting requests whose whole prompt fits beside those rows: their prompt tokens are on the host
already, and the token each one samples in N+1 feeds its first decode row in N+2 the same way (that row starts
the in-flight prompt's length past num_computed_tokens). Under continuous arrivals most steps admit someone, so this
is what keeps serving overlapped.

Only plain requests take this path: nothing that needs the sampled tokens on the host before the next step can
be built (grammars, bad_words, prompt logprobs, drafts). Penalties and min_tokens take it (the sampler counts
each row's token in flight as its last output, reading it on the device), and so do logprobs, read back with the
tokens. A prompt chunked over several steps, or a waiting request that is not plain, sends the engine back to
synchronous steps, which admit it as before; the pipeline starts again from the first synchronously scheduled step
whose every entry is sampled once.
"""

from __future__ import annotations

import logging
import time

from common.config import EngineConfig
from engine_core.batch import InFlight, SampledTokens, SchedulerOutput
from engine_core.model_runner import ModelRunner
from engine_core.request import Request
from engine_core.sampler import processes_beside_a_token_in_flight
from engine_core.scheduler import Scheduler

log = logging.getLogger("roseinfer.overlap")


def plain(req: Request) -> bool:
    """Whose next step needs nothing of its sampled token but the token itself, on the device (penalties and
    min_tokens read it there), and, for a prompt, nothing of its hidden states (prompt logprobs)."""
    p = req.params
    if req.grammar is not None or not processes_beside_a_token_in_flight(p):
        return False
    return req.decoding or p.prompt_logprobs is None


class DecodePipeline:
    @staticmethod
    def build(config: EngineConfig, scheduler: Scheduler, runner: ModelRunner, max_model_len: int,
              ) -> DecodePipeline | None:  # fmt: skip
        """A pipeline where --overlap-decode asks for one (auto: on CUDA) and every step is plain scheduling: no
        drafts, no tensor-parallel workers (their lockstep is synchronous), no round-robin rotation."""
        wanted = config.overlap_decode == "on" or (config.overlap_decode == "auto" and runner.device.type == "cuda")
        plain_engine = scheduler.speculator is None and runner.tp is None and scheduler.policy != "round-robin"
        return DecodePipeline(scheduler, runner, max_model_len) if wanted and plain_engine else None

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, max_model_len: int) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.max_model_len = max_model_len
        self.inflight: InFlight | None = None

    def try_launch(self, sched: SchedulerOutput) -> bool:
        """Launches a step of plain requests, each sampled once (a one-token decode or the rest of a prompt),
        without waiting for it; False: run it synchronously."""
        entries = zip(sched.requests, sched.num_new_tokens, sched.sample, strict=True)
        if not all(sample and plain(r) and not r.draft_token_ids and (n == 1 or not r.decoding)
                   for r, n, sample in entries):  # fmt: skip
            return False
        try:
            self.inflight = self.runner.launch(sched)
        except Exception:  # launch changes no request state: the synchronous path runs it and isolates any culprit
            log.exception("launching an overlapped step failed; running it synchronously")
            return False
        return True

    def advance(self) -> tuple[SchedulerOutput, SampledTokens]:
        """Launches the step after the one in flight when it can, then waits for the one in flight's tokens."""
        prev, self.inflight = self.inflight, None
        assert prev is not None
        following = self._lookahead(prev.sched)
        if following is not None:
            try:
                self.inflight = self.runner.launch(following, prev)
            except Exception:  # the synchronous path schedules these requests again, and isolates any culprit
                log.exception("launching an overlapped step failed; going on synchronously")
        sampled = prev.result()
        self.runner.last_forward_time = time.perf_counter() - prev.started
        return prev.sched, sampled

    def _lookahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """Step N+1 from step N: its requests that may go on, each allocated one slot past its tokens in flight, then
        the waiting requests it can admit. None: the synchronous path schedules the next step."""
        s = self.scheduler
        if s.gated:  # constrained requests waiting for their grammar: the synchronous path releases them
            return None
        following = SchedulerOutput()
        for req, n in zip(prev.requests, prev.num_new_tokens, strict=True):
            if req.finished or req.num_output_tokens + 1 >= req.params.max_tokens:
                continue  # ended, or ends with the token in flight
            if req.num_tokens + 1 >= self.max_model_len:
                continue
            # Slots up to the in-flight token's position: allocate_slots counts from num_computed_tokens, which
            # does not include step N's n tokens until its update.
            if not s.kv.allocate_slots(req, n + 1):
                return None  # memory is short: the synchronous path decides whom to preempt
            following.requests.append(req)
            following.num_new_tokens.append(1)
            following.sample.append(True)
        if not self._admit_whole_prompts(following):
            return None
        return following if following.requests else None

    def _admit_whole_prompts(self, following: SchedulerOutput) -> bool:
        """Admits waiting requests, in queue order, while seats, the budget left and free blocks last, each in one
        chunk of all its tokens. False: the first in the queue that fits needs the synchronous path (not plain, a
        prompt longer than the budget left, which takes chunks over several steps, or a preempted or resumed
        request, whose prompt and outputs are computed in separate steps: Request.next_chunk). One that does not
        fit waits as it would in the synchronous path, which admits nobody past it either."""
        s = self.scheduler
        if s.waiting:  # seats of requests finished since (the scheduler drops them lazily, when it schedules)
            s.running = [r for r in s.running if not r.finished]

        def whole(req: Request, end: int) -> bool:  # its first chunk is all its tokens: sampled at its end
            return plain(req) and end == req.num_tokens

        return s.admit_waiting(following, s.max_num_batched_tokens - following.total_tokens, whole)
