"""Continuous batching: which requests run this step and with how many tokens; what their new tokens mean.

Each step has a token budget. Running decodes come first (one token each, plus any drafts), then unfinished
prefills, then waiting requests, their prompts chunked to fit, so a long prompt never stalls running streams. When
KV blocks run out, the newest running request (under priority, the least important; in round-robin only one younger
than the requester, else the requester waits) is preempted: its blocks are freed and it is recomputed later (the
prefix cache usually gives most of them back).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable

from common.messages import EngineOutput, FinishReason, SchedulerStats
from engine_core.batch import SampledTokens, SchedulerOutput
from engine_core.kv_cache import Block, KVCacheManager
from engine_core.prompt_logprobs import take_prompt_logprobs, usable_prefix_hits
from engine_core.request import Request, RequestStatus
from engine_core.speculative import Speculator, merge_logprobs
from engine_core.structured import release


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs", speculator: Speculator | None = None) -> None:  # fmt: skip
        self.kv = kv
        self.speculator = speculator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.requests: dict[str, Request] = {}  # every live request
        self.running: list[Request] = []  # holding blocks, in admission order (newest last)
        self.waiting: list[tuple[tuple[int, ...], Request]] = []  # heap; aborted entries dropped lazily
        self.active: deque[Request] = deque()  # round-robin rotation of all live requests
        self.prefix_queries = self.prefix_hits = self.num_preempted = 0
        self.gated: list[Request] = []  # constrained requests whose grammar is still compiling
        self.early_outputs: list[EngineOutput] = []  # requests that ended before running (a grammar error)
        self.on_start: Callable[[str], None] | None = None  # told of each request's first admission (EngineStarted)

    # ---- requests in and out ----

    def _queue_key(self, req: Request) -> tuple[int, ...]:
        return (req.priority, req.seq_no) if self.policy == "priority" else (req.seq_no,)

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if req.grammar is not None:
            self.gated.append(req)
        else:
            self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        if self.policy == "round-robin":
            self.active.append(req)
        else:
            heapq.heappush(self.waiting, (self._queue_key(req), req))

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """Frees a request at once; queues drop it lazily when they next meet it."""
        if req.finished:
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.error = reason, error
        self.kv.free(req)
        del self.requests[req.request_id]

    def abort(self, request_ids: list[str]) -> None:
        for req in filter(None, map(self.requests.get, request_ids)):  # unknown or finished ids: aborts are idempotent
            self.finish(req, FinishReason.ABORT)

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    # ---- scheduling ----

    def schedule(self) -> SchedulerOutput:
        self.running = [r for r in self.running if not r.finished]
        if self.speculator is not None:
            self.speculator.start_step(len(self.running))
        if self.gated:
            self.release_gated()
        out = SchedulerOutput()
        if self.policy == "round-robin":
            self._schedule_round_robin(out)
        else:
            self._schedule_queue(out)
        out.put_decodes_first()
        return out

    def release_gated(self) -> None:
        """Constrained requests join the queue when their grammar is ready; nobody else waits for a compile."""
        ready, ended, self.gated = release(self.gated, wait=len(self.gated) == len(self.requests))
        for req in ready:
            self._enqueue(req)
        for req, (reason, error, code) in ended:
            self.finish(req, reason, error)
            self.early_outputs.append(EngineOutput(req.request_id, [], reason, error=error, error_code=code))

    def take_early_outputs(self) -> list[EngineOutput]:
        outputs, self.early_outputs = self.early_outputs, []
        return outputs

    def _schedule_queue(self, out: SchedulerOutput) -> None:
        budget = self.max_num_batched_tokens
        preempted_before = self.num_preempted
        scheduled: set[int] = set()  # ids of this step's requests: never preemption victims
        ongoing = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        ongoing += [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        if self.policy == "priority":  # the most important first, so that they are never the ones left short
            ongoing.sort(key=self._queue_key)
        for req in ongoing:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._allocate_running(req, budget, scheduled)
            if n:
                out.add(req, n)
                scheduled.add(id(req))
                budget -= n
        # Anyone preempted: memory is short, admit nobody (a victim, first in the queue, would restart at once).
        if self.num_preempted == preempted_before:
            self.admit_waiting(out, budget)

    def admit_waiting(self, out: SchedulerOutput, budget: int, takes: Callable[[Request], bool] | None = None) -> bool:
        """Queued requests in order while budget, seats and blocks last. `takes(req)` is asked of each one whose first
        chunk fits now; False where it refuses."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0][1]
            if req.finished:
                heapq.heappop(self.waiting)
                continue
            hits, n = self._first_chunk(req, budget)
            if not self.kv.can_allocate(req, n, hits):
                break
            if takes is not None and not takes(req):
                return False
            self._admit(req, hits, n)
            heapq.heappop(self.waiting)
            self.running.append(req)
            out.add(req, n)
            budget -= n
        return True

    def _schedule_round_robin(self, out: SchedulerOutput) -> None:
        """Time slicing: each step serves the next batch of the rotation; everyone keeps their blocks."""
        budget = self.max_num_batched_tokens
        batch: list[Request] = []
        while self.active and len(batch) < self.max_num_seqs:
            req = self.active.popleft()
            if not req.finished:
                batch.append(req)
        batch.sort(key=lambda r: r.num_tokens - r.num_computed_tokens > 1)  # decodes first, else rotation order
        scheduled: set[int] = set()
        reached: set[int] = set()
        for req in batch:
            if budget == 0:
                break
            reached.add(id(req))
            if req.block_ids or req.num_computed_tokens:
                n = self._allocate_running(req, budget, scheduled)
            else:
                n = self._admit(req, *self._first_chunk(req, budget))
                # Under memory pressure, preempt unscheduled younger holders one at a time until it fits.
                while n == 0 and (victim := self._pick_victim(scheduled | {id(req)}, requester=req)) is not None:
                    self._preempt(victim)
                    n = self._admit(req, *self._first_chunk(req, budget))
                if n:
                    self.running.append(req)
            if n:
                out.add(req, n)
                scheduled.add(id(req))
                budget -= n
        # Those the budget did not reach go first next step, the others to the back of the rotation.
        self.active.extendleft(reversed([r for r in batch if not r.finished and id(r) not in reached]))
        self.active.extend(r for r in batch if not r.finished and id(r) in reached)

    def _first_chunk(self, req: Request, budget: int) -> tuple[list[Block], int]:
        """A waiting request's prefix-cache hits and how many tokens after them the budget lets it compute."""
        hits = usable_prefix_hits(req, self.kv.get_computed_blocks(req), self.kv.block_size)
        return hits, req.next_chunk(budget, len(hits) * self.kv.block_size)

    def _admit(self, req: Request, hits: list[Block], n: int) -> int:
        """Takes the hits and allocates the n tokens after them; returns n, 0 if they do not fit."""
        if not self.kv.allocate_slots(req, n, hits):
            return 0
        if req.num_preemptions == 0:  # a recompute's hits are mostly its own blocks: not what the cache saved
            self.prefix_queries += req.num_tokens
            self.prefix_hits += len(hits) * self.kv.block_size
        req.status = RequestStatus.RUNNING
        if req.num_preemptions == 0 and self.on_start is not None:  # before its first step runs
            self.on_start(req.request_id)
        return n

    def _allocate_running(self, req: Request, budget: int, protected: set[int]) -> int:
        """Slots for a running request's tokens this step: the rest of its prompt, chunked to the budget, or its
        decode and any drafts (dropped when they do not fit as they are). 0 if it cannot run this step."""
        rest = req.num_tokens - req.num_computed_tokens
        req.draft_token_ids = self.speculator.draft(req, budget) if self.speculator and rest == 1 else []
        if req.draft_token_ids and self.kv.allocate_slots(req, 1 + len(req.draft_token_ids)):
            return 1 + len(req.draft_token_ids)
        req.draft_token_ids = []
        n = req.next_chunk(budget, req.num_computed_tokens)
        return n if self._allocate_or_preempt(req, n, protected) else 0

    def _allocate_or_preempt(self, req: Request, n: int, protected: set[int]) -> bool:
        """Allocates n more slots for a running request, preempting others as needed (_pick_victim). False if it
        could not: `req` itself was preempted, or, in round-robin, it keeps its blocks and waits for a turn."""
        while not self.kv.allocate_slots(req, n):
            victim = self._pick_victim(protected | {id(req)}, requester=req)
            if victim is None and self.policy == "round-robin":
                return False
            victim = victim or req
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _pick_victim(self, protected: set[int], requester: Request) -> Request | None:
        """Whom `requester` may preempt; None: nobody (then it yields itself, or in round-robin waits)."""
        candidates = [r for r in self.running if id(r) not in protected and r.status == RequestStatus.RUNNING]
        if self.policy == "round-robin":  # only younger ones: the oldest always progresses, so no ping-pong
            candidates = [r for r in candidates if r.seq_no > requester.seq_no]
        if not candidates:
            return None
        # The least important (under fcfs all are equal), the newest first among equals; the requester included. By
        # seq_no, not place in `running`: a recomputed old request goes to its end.
        key = (lambda r: (r.priority, r.seq_no)) if self.policy == "priority" else (lambda r: r.seq_no)
        victim = max([*candidates, requester], key=key)
        return None if victim is requester else victim

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preempted += 1
        self.running.remove(req)
        if self.policy != "round-robin":  # round-robin keeps it in the rotation
            heapq.heappush(self.waiting, (self._queue_key(req), req))

    # ---- results ----

    def update(self, out: SchedulerOutput, sampled: SampledTokens, outputs: list[EngineOutput]) -> None:
        """Appends sampled tokens, applies stop conditions, frees finished requests, caches full blocks. Outputs go
        to the caller's list as they are made, so that a raise midway loses none of those made before it."""
        j = 0
        for req, n, is_sampled in zip(out.requests, out.num_new_tokens, out.sample, strict=True):
            drafts, req.draft_token_ids = req.draft_token_ids, []
            if is_sampled:
                rows = 1 + len(drafts)
                tokens, logprobs = sampled.token_ids[j : j + rows], sampled.logprobs[j : j + rows]
                j += rows
            if req.finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += n - len(drafts)  # a draft's K/V counts once its token is kept
            if not is_sampled:
                self.kv.cache_full_blocks(req)
                continue
            if req.params.max_tokens == 0:  # scoring a prompt or embedding it: prefill only, no token
                self.kv.cache_full_blocks(req)
                self.finish(req, FinishReason.LENGTH)
                outputs.append(EngineOutput(req.request_id, [], FinishReason.LENGTH, None, req.num_cached_tokens,
                                            prompt_logprobs=take_prompt_logprobs(req), pooled=req.pooled))
                continue
            kept: list[int] = []
            for i, token in enumerate(tokens):  # row i counts only while every draft before it was right
                if i and tokens[i - 1] != drafts[i - 1]:
                    break
                req.token_ids.append(token)
                kept.append(token)
                reason = req.check_stop(self.max_model_len)
                if req.grammar is not None:
                    reason = req.grammar.advance(token, reason)
                if reason is not None:
                    break
            req.num_computed_tokens += len(kept) - 1
            if self.speculator is not None:
                self.speculator.count(drafts, kept)
            self.kv.cache_full_blocks(req)
            error, code = req.grammar.failure() if reason == FinishReason.ERROR and req.grammar else (None, None)
            if reason is not None:
                self.finish(req, reason, error)
            lp = logprobs[0] if len(kept) == 1 else merge_logprobs(logprobs[: len(kept)])
            outputs.append(EngineOutput(req.request_id, kept, reason, req.stop_token_id,
                                        req.num_cached_tokens, lp, error, take_prompt_logprobs(req), error_code=code))

    def stats(self, step_time_s: float = 0.0, forward_time_s: float = 0.0) -> SchedulerStats:
        num_running, spec = sum(1 for r in self.running if not r.finished), self.speculator
        return SchedulerStats(
            num_running=num_running, num_waiting=len(self.requests) - num_running,
            kv_usage=self.kv.usage, num_blocks_in_use=self.kv.num_used_blocks,
            prefix_queries=self.prefix_queries, prefix_hits=self.prefix_hits, num_preempted=self.num_preempted,
            step_time_s=step_time_s, forward_time_s=forward_time_s,
            num_draft_tokens=spec.num_draft_tokens if spec else 0,
            num_accepted_tokens=spec.num_accepted_tokens if spec else 0)  # fmt: skip
