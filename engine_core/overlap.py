"""Overlapped steps: the host schedules and launches step N+1 before it reads step N's tokens back, and does step
N's bookkeeping (stop checks, outputs, freeing) while the GPU runs N+1. A synchronous step leaves the GPU idle while
the host works, which at a 1B model's batch of 256 was half of every step.

Step N+1 holds the requests of step N that may go on, each where N leaves it (SchedulerOutput.ahead: N's tokens,
which N's update has not counted yet). One that N samples gets one decode row whose input is that token, taken on
the device (ModelRunner.launch), its KV slot allocated ahead. One that N does not sample (a prompt chunked to the
budget) gets its next chunk, whose tokens are on the host. A request that step N finishes (an EOS, an abort) has a
row in N+1 whose token is dropped (its update skips finished requests) and whose KV write lands past its last
registered block, in blocks it no longer holds: any later holder's writes queue after it on the stream. Requests
known to end with the token in flight (their max_tokens or the context length) get no row.

Step N+1 then admits waiting requests as the synchronous scheduler does (Scheduler.admit_waiting), their first
chunk cut to the budget left; a preempted or resumed request computes its prompt, then its outputs, in chunks of
later steps the same way. Under continuous arrivals most steps admit someone, so this is what keeps serving
overlapped.

Penalties and min_tokens run beside the token in flight (the sampler counts it as the row's last output, reading
it on the device), and logprobs are read back with the tokens. A grammar's mask and bad_words need that token on
the host: a step holding such a row is launched with its logits only, and sampled once the update of the step
before has fed the token to the grammar (sample_late), so the host's bookkeeping still runs beside the forward.
Prompt logprobs (read from a prompt's hidden states) and drafts keep a request off this path: a waiting request
that asks for them, or KV blocks that run short (someone must be preempted), sends the engine back to synchronous
steps; the pipeline starts again from the first synchronously scheduled step of plain requests only.
"""

from __future__ import annotations

import logging
import time

from common.config import EngineConfig
from engine_core.batch import InFlight, SampledTokens, SchedulerOutput
from engine_core.model_runner import ModelRunner
from engine_core.request import Request
from engine_core.scheduler import Scheduler

log = logging.getLogger("roseinfer.overlap")


def plain(req: Request) -> bool:
    """Whose steps can be launched before the step before them is read back: all but a prompt that asks for its
    prompt logprobs (the host accumulates them at each chunk) or a pooling request's (what it pools, not a token, is
    the result). Drafts run synchronously too (DecodePipeline.build)."""
    return req.decoding or (req.params.prompt_logprobs is None and not req.pool)


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
        """Launches a step of plain requests without waiting for it; False: run it synchronously."""
        if not all(plain(r) and not r.draft_token_ids for r in sched.requests):
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

    def sample_late(self) -> None:
        """After the update of the step before: samples the step in flight if it waited for that (a grammar or
        bad_words read the token the update appended)."""
        flight = self.inflight
        if flight is None or flight.logits is None:
            return
        try:
            self.runner.sample_late(flight)
        except Exception:  # its requests' state is untouched: the synchronous path runs them again
            log.exception("sampling an overlapped step failed; going on synchronously")
            self.inflight = None

    def _lookahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """Step N+1 from step N: N's requests that may go on, decode rows first, then the next chunks of prompts, each
        allocated past its tokens in flight; then the waiting requests it can admit. None: the synchronous path
        schedules the next step."""
        s = self.scheduler
        if s.gated:  # constrained requests whose grammar is ready join the queue (those that fail end at once)
            s.release_gated()
        following = SchedulerOutput()
        budget = s.max_num_batched_tokens
        entries = list(zip(prev.requests, prev.num_new_tokens, prev.sample, strict=True))
        for req, n, sampled in [e for e in entries if e[2]] + [e for e in entries if not e[2]]:
            if req.finished:
                continue
            if sampled:  # one decode row, its input the token N samples
                if req.num_output_tokens + 1 >= req.params.max_tokens or req.num_tokens + 1 >= self.max_model_len:
                    continue  # ends with the token in flight
                m = 1
            elif (m := req.next_chunk(budget, req.num_computed_tokens + n)) == 0:
                return None  # no budget left for its next chunk: the synchronous path decides who waits
            # allocate_slots counts from num_computed_tokens, which does not include N's n tokens until its update.
            if not s.kv.allocate_slots(req, n + m):
                return None  # memory is short: the synchronous path decides whom to preempt
            following.add(req, m, ahead=n, sample=True if sampled else None)
            budget -= m
        if s.waiting:  # seats of requests finished since (the scheduler drops them lazily, when it schedules)
            s.running = [r for r in s.running if not r.finished]
        # The first in the queue that is not plain needs the synchronous path; one that does not fit waits, as it
        # would there.
        if not s.admit_waiting(following, budget, plain):
            return None
        following.put_decodes_first()  # a resumed request may start with its outputs, past its cached prompt
        return following if following.requests else None
