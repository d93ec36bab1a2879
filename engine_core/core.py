"""EngineCore: add / abort / step, steppable in tests without sockets (engine_core/busy_loop.py runs the process)."""

from __future__ import annotations

import dataclasses
import logging
import time

from common.config import EngineConfig
from common.messages import (
    EngineOutput,
    EngineReady,
    EngineRequest,
    FinishReason,
    LoraRef,
    SchedulerStats,
)
from common.model_source import model_eos_ids, parse_hf_overrides, resolve_model
from common.pooling import pick_runner
from engine_core.batch import SampledTokens, SchedulerOutput
from engine_core.kv_cache import KVCacheManager
from engine_core.model_runner import ModelRunner
from engine_core.models.loader import load_config
from engine_core.overlap import DecodePipeline
from engine_core.request import Request
from engine_core.request_checks import invalid_request
from engine_core.scheduler import Scheduler
from engine_core.speculative import Speculator
from engine_core.structured import GrammarService

log = logging.getLogger("roseinfer.engine")

RanParts = list[tuple[SchedulerOutput, SampledTokens]]  # sub-batches of a step that executed, with their tokens


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        overrides = parse_hf_overrides(config.hf_overrides)
        source = resolve_model(config.model, overrides=overrides, tokenizer=config.tokenizer)
        self.model_name = source.name
        # generate or pooling (common/pooling.py), decided once here: the TP workers take the engine's config
        runner = pick_runner(config.runner, source.path, source.architecture, overrides)
        self.config = config = dataclasses.replace(config, runner=runner)
        self.pooling = config.runner == "pooling"
        hf_config = load_config(source.path, overrides)
        limit = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", 2048)
        max_model_len = min(config.max_model_len or min(limit, 8192), limit)
        self.runner = ModelRunner(config, source, max_model_len)
        # A single request must always fit in the cache, or it could wait forever.
        self.max_model_len = min(max_model_len, self.runner.num_blocks * config.block_size)
        self.vocab_size = self.runner.vocab_size
        self.max_logprobs = config.logprobs_limit(self.vocab_size)
        self.eos_token_ids = model_eos_ids(source.path, hf_config)
        self.grammars = GrammarService(source.tokenizer, self.vocab_size, self.eos_token_ids)  # constrained decoding
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        speculator = Speculator.build(config.speculative_config, self.max_model_len)  # n-gram drafts, if asked
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.runner.config.max_num_batched_tokens,
                                   self.max_model_len, config.scheduling_policy, speculator)  # fmt: skip
        self.pipeline = DecodePipeline.build(config, self.scheduler, self.runner, self.max_model_len)
        self._rejected: list[EngineOutput] = []
        self._seq_no = 0
        self.last_step_time = 0.0

    def ready_message(self) -> EngineReady:
        return EngineReady(self.config.epoch, self.model_name, self.max_model_len, self.config.block_size,
                           self.runner.num_blocks, self.vocab_size, self.eos_token_ids, self.config.runner)  # fmt: skip

    # ---- requests ----

    def add_request(self, msg: EngineRequest) -> None:
        error = invalid_request(msg, self.vocab_size, self.max_model_len, self.scheduler.requests, self.pooling,
                                self.max_logprobs)
        if error is None and msg.lora is not None:  # loaded on first use: a restarted engine resumes its requests
            error = self.load_lora(msg.lora)
        if error is not None:
            self._rejected.append(EngineOutput(msg.request_id, [], FinishReason.ERROR, error=error))
            return
        if not msg.eos_token_ids:
            msg.eos_token_ids = self.eos_token_ids
        self._seq_no += 1
        try:
            request = Request(msg, self._seq_no)
            request.lora_slot = msg.lora.id if msg.lora is not None else 0
            request = self.grammars.attach(request)
        except Exception as exc:  # the request fails alone: it never started, so a crash would blame nobody
            log.exception("request %s could not be added", msg.request_id)
            self._rejected.append(EngineOutput(msg.request_id, [], FinishReason.ERROR, error=f"{exc!r}"))
            return
        self.scheduler.add(request)

    def abort(self, request_ids: list[str]) -> None:
        self.scheduler.abort(request_ids)

    def load_lora(self, ref: LoraRef) -> str | None:
        """Why the adapter cannot serve here, or None once it is loaded."""
        if not self.config.enable_lora:
            return "LoRA adapters are not enabled (start the server with --enable-lora)"
        return self.runner.lora.ensure(ref)

    def unload_lora(self, ref: LoraRef) -> None:
        """Its weights go once no live request uses it (at once if none does)."""
        self.runner.lora.retire(ref.id)
        self._release_loras()

    def _release_loras(self) -> None:
        if self.runner.lora.retiring:
            self.runner.lora.release({r.lora_slot for r in self.scheduler.requests.values()})

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._rejected) or self._in_flight is not None

    @property
    def _in_flight(self) -> SchedulerOutput | None:
        return self.pipeline.inflight.sched if self.pipeline is not None and self.pipeline.inflight else None

    # ---- one step ----

    def step(self, before_update=None) -> list[EngineOutput]:
        """schedule -> execute -> (aborts that arrived meanwhile) -> update. Returns this step's outputs."""
        outputs, self._rejected = self._rejected, []
        start = time.perf_counter()
        if (in_flight := self._in_flight) is not None:  # engine_core/overlap.py: the next step launches first
            try:
                ran, failed = [self.pipeline.advance()], []  # type: ignore[union-attr]
            except Exception as exc:
                log.exception("an overlapped step failed")
                self.pipeline.inflight = None  # type: ignore[union-attr]  # the device's state is unknown: resync
                ran, failed = [], self._fail(in_flight.requests, f"engine step failed: {exc!r}")
        else:
            if not self.scheduler.has_work:
                return outputs
            sched = self.scheduler.schedule()
            if not sched.requests or (self.pipeline is not None and self.pipeline.try_launch(sched)):
                return outputs + self.scheduler.take_early_outputs()  # a launched step's tokens come with the next
            ran, failed = self._execute_isolating(sched)
        outputs += self.scheduler.take_early_outputs()  # constrained requests whose grammar failed
        outputs += failed
        if before_update is not None:
            before_update()
        for part, sampled in ran:
            # Update is bookkeeping, not tensor work: a raise there is a bug that may have half-applied the step of
            # the request it raised on. The outputs made before it stand (their requests are whole); the rest fail.
            made: list[EngineOutput] = []
            try:
                self.scheduler.update(part, sampled, made)
            except Exception as exc:
                log.exception("update failed")
                made += self._fail(part.requests, f"engine update failed: {exc!r}", {o.request_id for o in made})
            outputs += made
        if self.pipeline is not None:
            self.pipeline.sample_late()
        self._release_loras()  # an unloaded adapter whose last request just ended
        self.last_step_time = time.perf_counter() - start
        return outputs

    def _execute_isolating(self, sched: SchedulerOutput) -> tuple[RanParts, list[EngineOutput]]:
        """Runs the batch; if it raises, runs each half on its own, recursively, so that only a request that
        raises alone fails and the rest of the step goes on. Returns the parts that ran with their tokens, in
        batch order, and the culprits' outputs. Retrying is safe: execute changes no request state and only
        rewrites the same KV slots; num_computed_tokens moves in update, once per part."""
        try:
            return [(sched, self.runner.execute(sched))], []
        except Exception as exc:
            if len(sched.requests) == 1:
                log.exception("request %s failed its step", sched.requests[0].request_id)
                return [], self._fail(sched.requests, f"engine step failed: {exc!r}")
            log.debug("a step of %d requests failed (%r): splitting it", len(sched.requests), exc)
        mid = len(sched.requests) // 2
        ran: RanParts = []
        failed: list[EngineOutput] = []
        for half in (slice(None, mid), slice(mid, None)):
            # A slice of a decodes-first batch is still decodes-first.
            part_ran, part_failed = self._execute_isolating(sched.part(half))
            ran += part_ran
            failed += part_failed
        return ran, failed

    def _fail(self, requests: list[Request], error: str, sent: set[str] | None = None) -> list[EngineOutput]:
        """An ERROR output for each request with none sent, also one that update finished before it made its output
        (the scheduler has forgotten it: its stream would wait forever). An aborted request needs none."""
        failed = []
        for req in requests:
            if req.request_id in (sent or ()) or req.finish_reason == FinishReason.ABORT:
                continue
            self.scheduler.finish(req, FinishReason.ERROR, error)  # a no-op if update finished it
            failed.append(EngineOutput(req.request_id, [], FinishReason.ERROR, error=error))
        return failed

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats(self.last_step_time, self.runner.last_forward_time)
        stats.num_loras = len(self.runner.lora.names)
        return stats
