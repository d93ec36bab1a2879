"""Scheduler + KV cache driven by hypothesis with a fake deterministic model, invariants checked after every step.

The fake model's next token is a function of the whole token sequence, so a request's outputs are fixed whatever
the batching, preemption, prefix hits or speculative drafts; the fake KV cache stores, per slot, a digest of the
prefix ending at that position, so a request that reads a block it should not (wrong sharing, a stale hit, an
overwritten block, a rejected draft's K/V counted as computed) is caught. Every policy must finish every request.
"""

from __future__ import annotations

import zlib

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from common.config import SpeculativeConfig
from common.messages import EngineRequest, FinishReason, SamplingParams
from engine_core.batch import SampledTokens
from engine_core.kv_cache import KVCacheManager
from engine_core.prompt_logprobs import score_prompts
from engine_core.request import Request
from engine_core.scheduler import Scheduler
from engine_core.speculative import Speculator

V = 5
EOS = 0


def next_token(tokens) -> int:
    return zlib.crc32(repr(tuple(tokens)).encode()) % V


def digest(tokens) -> int:
    return zlib.crc32(repr(tuple(tokens)).encode())


class FakeLM:
    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], V)


def continuation(prompt, k):
    toks = list(prompt)
    for _ in range(k):
        toks.append(next_token(toks))
    return toks[len(prompt):]


class Machine(RuleBasedStateMachine):
    @initialize(bs=st.sampled_from([1, 2, 4]), blocks=st.integers(2, 10),
                policy=st.sampled_from(["fcfs", "priority", "round-robin"]), prefix=st.booleans(),
                seqs=st.integers(1, 4), budget=st.integers(1, 12), shrink=st.integers(0, 3),
                drafts=st.sampled_from([0, 1, 3]))
    def setup(self, bs, blocks, policy, prefix, seqs, budget, shrink, drafts):
        self.bs = bs
        self.kv = KVCacheManager(blocks, bs, prefix)
        self.max_model_len = max(2, blocks * bs - shrink)
        spec = Speculator(SpeculativeConfig(drafts, 1, 2, None), self.max_model_len) if drafts else None
        self.sched = Scheduler(self.kv, seqs, budget, self.max_model_len, policy, spec)
        self.seq = 0
        self.fake_kv: dict[int, int] = {}
        self.expected: dict[str, list[int]] = {}  # rid -> full expected continuation (beyond resumed tokens)
        self.got: dict[str, list[int]] = {}
        self.finished: dict[str, FinishReason] = {}
        self.reqs: dict[str, Request] = {}
        self.prompts: list[list[int]] = []
        self.empty_steps = 0

    # ---- requests ----

    @rule(data=st.data())
    def add(self, data):
        d = data.draw
        if self.prompts and d(st.booleans()):
            prompt = list(d(st.sampled_from(self.prompts)))
        else:
            n = d(st.integers(1, self.max_model_len - 1))
            prompt = d(st.lists(st.integers(1, 2), min_size=n, max_size=n))
        resumed = d(st.integers(0, 3)) if d(st.integers(0, 4)) == 0 else 0
        outs = continuation(prompt, resumed)
        if EOS in outs:
            outs = outs[: outs.index(EOS)]
        if len(prompt) + len(outs) >= self.max_model_len:
            return  # the engine rejects it
        max_tokens = d(st.integers(0, self.max_model_len))
        if outs and max_tokens <= len(outs):
            max_tokens = len(outs) + 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=d(st.booleans()),
                                prompt_logprobs=d(st.sampled_from([None, 0, 1])))
        self.seq += 1
        rid = f"r{self.seq}"
        msg = EngineRequest(rid, prompt, params, eos_token_ids=[EOS], priority=d(st.integers(0, 2)),
                            output_token_ids=outs)
        req = Request(msg, self.seq)
        self.prompts.append(prompt)
        self.reqs[rid] = req
        self.got[rid] = []
        self.sched.add(req)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        was_live = rid in self.sched.requests
        self.sched.abort([rid])
        if was_live:
            self._finish(rid, FinishReason.ABORT)

    @rule()
    def reset_cache(self):
        self.kv.reset_prefix_cache()

    def _finish(self, rid, reason):
        assert rid not in self.finished, f"{rid} finished twice ({self.finished[rid]} then {reason})"
        self.finished[rid] = reason
        req = self.reqs[rid]
        assert req.block_ids == [], f"{rid} holds blocks after finishing"

    # ---- one step ----

    @rule(abort_mid=st.integers(0, 5), data=st.data())
    def step(self, abort_mid, data):
        self._step(abort_mid, data)

    def _step(self, abort_mid=0, data=None):
        if not self.sched.has_work:
            return
        out = self.sched.schedule()
        if not out.requests and self.sched.policy == "round-robin":
            return  # the rotation moves on: an empty round-robin step is not final
        if not out.requests:
            raise AssertionError(f"stall: {len(self.sched.requests)} live requests, nothing scheduled; "
                                 f"running={[r.request_id for r in self.sched.running]} free={self.kv.num_free_blocks}")
        assert out.total_tokens <= self.sched.max_num_batched_tokens
        assert len(out.requests) == len({id(r) for r in out.requests}), "request scheduled twice in a step"
        bs = self.bs
        # fake execute: read then write the KV of each entry
        inputs = {}  # the tokens each entry runs: its own, or its last one and its drafts
        for req, n in zip(out.requests, out.num_new_tokens, strict=True):
            assert not req.finished and req.status.name == "RUNNING"
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            inputs[id(req)] = req.token_ids[: start + 1] + req.draft_token_ids if req.draft_token_ids else req.token_ids
            assert n > 0 and end <= len(inputs[id(req)])
            assert len(req.block_ids) >= -(-end // bs), f"{req.request_id}: too few blocks"
            for p in range(start):
                slot = req.block_ids[p // bs] * bs + p % bs
                assert self.fake_kv.get(slot) == digest(req.token_ids[: p + 1]), \
                    f"{req.request_id} reads wrong KV at position {p} (block {req.block_ids[p // bs]})"
            for p in range(start, end):
                b = req.block_ids[p // bs]
                assert self.kv.pool.blocks[b].ref_count == 1, f"{req.request_id} writes shared block {b}"
        for req, n in zip(out.requests, out.num_new_tokens, strict=True):
            for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
                self.fake_kv[req.block_ids[p // bs] * bs + p % bs] = digest(inputs[id(req)][: p + 1])
        hidden = torch.zeros(out.total_tokens, 1)
        score_prompts(FakeLM(), hidden, out, V)
        sampled = [next_token(inputs[id(r)][: r.num_tokens + j])
                   for r, s in zip(out.requests, out.sample, strict=True) if s
                   for j in range(1 + len(r.draft_token_ids))]
        if abort_mid == 1 and data is not None:
            victim = data.draw(st.sampled_from(out.requests))
            if not victim.finished:
                self.sched.abort([victim.request_id])
                self._finish(victim.request_id, FinishReason.ABORT)
        outputs: list = []
        self.sched.update(out, SampledTokens(sampled, [None] * len(sampled)), outputs)
        for o in outputs:
            req = self.reqs[o.request_id]
            self.got[o.request_id] += o.new_token_ids
            if o.prompt_logprobs is not None:
                assert len(o.prompt_logprobs.token_logprobs) == req.num_prompt_tokens - 1
            if o.finish_reason is not None:
                self._finish(o.request_id, o.finish_reason)
        self.kv.check_integrity(list(self.sched.requests.values()))

    @invariant()
    def integrity(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_integrity(list(self.sched.requests.values()))
        for rid, req in self.reqs.items():
            if rid in self.finished:
                assert rid not in self.sched.requests
            resumed = req.num_output_tokens - len(self.got[rid])
            want = continuation(req.token_ids[: req.num_prompt_tokens], req.num_output_tokens)
            assert req.output_token_ids == want, f"{rid}: wrong tokens {req.output_token_ids} != {want}"
            assert resumed >= 0

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for _ in range(20000 if self.sched.policy == "round-robin" else 1500):
            if not self.sched.has_work:
                break
            self._step()
        assert not self.sched.has_work, "requests never finished"
        assert set(self.finished) == set(self.reqs)
        assert self.kv.num_used_blocks == 0
        for rid, req in self.reqs.items():
            if self.finished[rid] == FinishReason.ABORT:
                continue
            assert req.num_tokens <= self.max_model_len
            assert req.num_output_tokens <= max(req.params.max_tokens, 0) or req.params.max_tokens == 0
            if req.params.max_tokens == 0:
                assert self.got[rid] == []


TestScheduler = Machine.TestCase
TestScheduler.settings = settings(max_examples=400, stateful_step_count=30, deadline=None, derandomize=True,
                                  suppress_health_check=list(HealthCheck))
