"""Runs one scheduled step: flat input tensors -> our model over the paged KV cache -> sampled tokens.

Also owns the KV cache tensors and their sizing; the device and dtype come from engine_core/device.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import torch

from common.config import EngineConfig
from common.lora import lora_modules
from common.model_source import ResolvedModel, parse_hf_overrides
from common.pooling import read_pooling
from engine_core import distributed, huge_pages, memory_profile
from engine_core.attention import AttentionBackend, AttentionMetadata, PrefillChunk, select_backend
from engine_core.batch import InFlight, SampledTokens, SchedulerOutput
from engine_core.cpu_kernels import cpu_kernels
from engine_core.cuda_graphs import DecodeGraphs, graph_rows
from engine_core.device import (
    padded_size,
    pick_device,
    pick_dtype,
    pick_kv_cache_dtype,
    step_token_budget,
    tune_cpu_process,
)
from engine_core.lora import LoraAdapters
from engine_core.models.cpu_decode import DecodeStack
from engine_core.models.loader import load_model
from engine_core.models.quant import prepare_linears, quantization_hint
from engine_core.prompt_logprobs import score_prompts, wants_prompt_logprobs
from engine_core.pulse import Progress
from engine_core.sampler import Sampler, needs_processing, processes_beside_a_token_in_flight
from engine_core.transfer import padded_rows, to_device


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ResolvedModel, max_model_len: int) -> None:
        self.config = config
        model_path = source.path
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.kv_dtype = pick_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        # Tensor parallel: a worker has joined its group already; rank 0 starts it here (before the model
        # loads: the workers load theirs meanwhile, and sharding needs the rank).
        self.tp = distributed.group()
        if self.tp is None and config.tensor_parallel_size > 1:
            from engine_core.rendezvous import start_leader

            self.tp = start_leader(config, self.device, self.dtype, max_model_len)
        if self.tp is not None:
            self.device = self.tp.device
        budget = step_token_budget(config.max_num_batched_tokens, self.device)
        self.config = config = dataclasses.replace(config, max_num_batched_tokens=budget)
        if self.device.type == "cpu":
            tune_cpu_process(config.num_threads)
            cpu_kernels()  # built (once per machine, a few seconds) before the engine reports ready, not in a request
        self.block_size = config.block_size
        # Fail before loading anything where we can: too few explicit blocks; on CUDA, a card whose free memory is
        # below what we were asked to take (the snapshot is the baseline of the profile after the weights load).
        if config.num_kv_blocks:
            memory_profile.check_num_kv_blocks(config.num_kv_blocks, max_model_len, self.block_size)
        profiling = self.device.type == "cuda" and not config.num_kv_blocks
        start = memory_profile.snapshot_at_start(self.device, config.gpu_memory_utilization) if profiling else None
        # Embeddings or scores only: no LM head (a classifier's head instead), no decode steps
        overrides = parse_hf_overrides(config.hf_overrides)
        self.pooling = read_pooling(model_path, overrides) if config.runner == "pooling" else None
        self.model = load_model(model_path, self.dtype, self.device, max_model_len, self.pooling, overrides,
                                source.tokenizer, config.quantization)  # fmt: skip
        # int8 or int4, or packed bf16 on CPU; min_rows keeps a row's result independent of the rows beside it.
        self.min_rows = prepare_linears(self.model, config.quantization, self.device, self.dtype)
        if self.device.type == "cpu":
            huge_pages.move_packed_weights(self.model)  # read once per step: fewer TLB misses
        quantization_hint(model_path, config.quantization, self.device, self.dtype)  # a 4- or 8-bit GGUF, dequantized
        # Before the KV cache is sized, so that their memory counts; put in the model once the base layers are taken.
        self.lora = LoraAdapters.load(self.model, lora_modules(config), config.max_lora_rank, self.device, self.dtype)
        self.progress = Progress()  # liveness inside long steps (engine_core/pulse.py); the LM head is now final
        self.progress.watch(self.model)
        self.lora.tick = self.progress.tick  # a runtime adapter load is a step's work too
        self.vocab_size = self.model.config.vocab_size
        attn = self.model.attention_layers()[0]  # this rank's heads
        self.attn_backend: AttentionBackend = select_backend(
            config.attention_backend, self.device, self.dtype, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            self.block_size, self.kv_dtype,
        )
        self.decode_graphs: DecodeGraphs | None = None  # captured once the KV cache exists; the profile runs eager
        # More blocks than max_num_seqs full-length requests need would only be idle prefix cache.
        most_useful = config.max_num_seqs * -(-max_model_len // self.block_size)
        self.num_blocks = config.num_kv_blocks or min(self._blocks_that_fit(start, max_model_len), most_useful)
        if self.tp is not None:  # every rank holds a slice of every block: one count for all
            self.num_blocks = distributed.all_min(self.num_blocks)
        self._allocate_kv_cache()
        if not self.pooling and self.device.type == "cpu" and self.tp is None and hasattr(self.model, "decode_stack"):
            self.model.decode_stack = DecodeStack.build(self.model)  # decode-only steps in one C call
        if self._captures_graphs:
            width = -(-max_model_len // self.block_size)
            self.decode_graphs = DecodeGraphs(self.model, graph_rows(config), width, self.scratch_slot,
                                              self.block_size, self.device, self.attn_backend.index_dtype,
                                              mixed=config.mixed_step_graphs)  # fmt: skip
            self.decode_graphs.capture_all()
        self.lora.attach()  # after the graphs (base layers only) and the decode stack (it takes them too)
        self.sampler = Sampler(self.device, self.vocab_size, config.seed, config.logprobs_mode)
        self.last_forward_time = 0.0

    @property
    def _captures_graphs(self) -> bool:
        """Decode steps replayed from CUDA graphs: only where the attention's cost does not grow with their fixed
        full-width block tables, and where there are decode steps (a pooling engine has none)."""
        return (self.device.type == "cuda" and not self.config.enforce_eager and self.tp is None
                and self.attn_backend.graphable and not self.pooling)  # fmt: skip

    # ---- KV cache ----

    def _bytes_per_block(self) -> int:
        layers = len(self.model.attention_layers())
        per_token = 2 * layers * self.model.num_kv_heads * self.model.head_dim * self.kv_dtype.itemsize
        return per_token * self.block_size

    def _blocks_that_fit(self, start: memory_profile.StartSnapshot | None, max_model_len: int) -> int:
        """Raises KvCacheSizeError (engine_core/memory_profile.py) when one max_model_len request would not fit."""
        per_block, bs = self._bytes_per_block(), self.block_size
        if start is not None:
            reserve = memory_profile.CUDA_GRAPH_RESERVE if self._captures_graphs else 0
            mem = memory_profile.profile_gpu(self, start, max_model_len, reserve, self.padded_size)
            return memory_profile.gpu_kv_blocks(mem, self.config.gpu_memory_utilization, per_block, max_model_len, bs)
        gib = self.config.kv_cache_memory  # CPU: the whole group's
        return memory_profile.cpu_kv_blocks(gib, distributed.tp_size(), per_block, max_model_len, bs)

    def _allocate_kv_cache(self) -> None:
        layers = self.model.attention_layers()
        # One block more than the scheduler knows of: padding tokens write their KV there, and nobody reads it.
        shape = (2, len(layers), self.num_blocks + 1, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        self.scratch_slot = self.num_blocks * self.block_size
        if self.device.type == "cpu":
            self.kv_cache = huge_pages.zeros(shape, self.kv_dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            layer.attn_backend = self.attn_backend

    # ---- one step ----

    def padded_size(self, num_tokens: int) -> int:
        return padded_size(num_tokens, self.min_rows)

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """An entry whose input is a token still in flight (SchedulerOutput.in_flight_input) gets input id 0 here,
        for launch() to fill on the device.

        With --mixed-step-graphs, a step that fits the largest decode graph puts prompt tokens in decode rows too
        (served slower than eager mixed steps on an H100, so off by default): each attends to the keys
        up to its own position, as a draft's row does, which is causal attention over the chunk and the cache
        (every row's K/V is stored before any row attends). One replay then replaces an eager forward, whose
        kernel launches alone keep a GPU's host busy for milliseconds however few the tokens (a 1B model's eager
        decode step at batch 64 took 9.2 ms on an H200, 3.3 ms replayed)."""
        bs = self.block_size
        graphs = self.decode_graphs
        as_decode_rows = graphs is not None and graphs.takes_prompts(out, self._bytes_per_block() // bs)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []
        prefills: list[PrefillChunk] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        lora_slots: list[int] = []
        for i, (req, n, sample) in enumerate(zip(out.requests, out.num_new_tokens, out.sample, strict=True)):
            start = out.start(i)
            end = start + n
            drafts = req.draft_token_ids
            if as_decode_rows or out.decodes(i):  # decode rows: each attends to the keys up to its position
                for p in range(start, end):
                    decode_tables.append(req.block_ids[: p // bs + 1])
                    decode_lens.append(p + 1)
            else:
                block_ids = to_device(req.block_ids[: (end + bs - 1) // bs], self.device, torch.long)
                prefills.append(PrefillChunk(len(ids), n, end, block_ids))
            if out.in_flight_input(i):
                ids.append(0)
            else:
                ids += [req.token_ids[start], *drafts] if drafts else req.token_ids[start:end]
            positions += range(start, end)
            lora_slots += [req.lora_slot] * n
            slots += [req.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            if sample:  # the last position; with drafts, every row
                sample_idx += range(len(ids) - 1 - len(drafts), len(ids))
        pad = self.padded_size(len(ids)) - len(ids)
        ids += [0] * pad
        positions += [0] * pad
        slots += [self.scratch_slot] * pad
        dev = self.device
        tables = lens = None
        if decode_tables:
            index = self.attn_backend.index_dtype
            tables = to_device(padded_rows(decode_tables), dev, index)
            lens = to_device(decode_lens, dev, index)
        meta = AttentionMetadata.build(to_device(slots, dev, torch.long), tables, lens, prefills, bs)
        self.lora.plan(lora_slots)  # padding rows are the base model's
        return to_device(ids, dev, torch.long), to_device(positions, dev, torch.long), meta, sample_idx

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.lora.active:  # rows of an adapter (engine_core/lora.py): no graph; the decode stack where it adds them
            with self.lora.eager(self.model):
                return self.model(input_ids, positions, meta)
        if self.decode_graphs is not None and self.decode_graphs.fits(meta.num_decodes, meta):
            return self.decode_graphs.run(input_ids, positions, meta)
        with distributed.lockstep():  # tensor parallel: the workers run the same forward
            if self.tp is not None:
                distributed.send_step(input_ids, positions, meta)
            return self.model(input_ids, positions, meta)

    def _logits(self, hidden: torch.Tensor, sample_idx: list[int]) -> torch.Tensor:
        """The sampled rows' logits, computed over a padded row count (padded_size)."""
        rows = sample_idx + sample_idx[-1:] * (self.padded_size(len(sample_idx)) - len(sample_idx))
        return self.model.compute_logits(hidden[to_device(rows, self.device, torch.long)])[: len(sample_idx)]

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: InFlight | None = None) -> InFlight:
        """A step of plain requests (engine_core/overlap.py), sampled on the device and not waited for. With prev,
        an entry whose input is prev's token for its request (SchedulerOutput.in_flight_input) takes it on the
        device; prev need not have finished. Where a grammar or bad_words would read that token on the host, the
        step's sampling waits for sample_late."""
        started = time.perf_counter()
        input_ids, positions, meta, sample_idx = self._prepare(out)
        firsts = list(itertools.accumulate(out.num_new_tokens[:-1], initial=0))  # each entry's first row
        fed = [i for i in range(len(out.requests)) if out.in_flight_input(i)]
        if fed:
            assert prev is not None and prev.tokens is not None
            source = {id(r): k for k, r in enumerate(prev.sched.sampled_requests)}  # prev's tokens: one per entry
            rows = to_device([firsts[i] for i in fed], self.device, torch.long)
            sources = to_device([source[id(out.requests[i])] for i in fed], self.device, torch.long)
            input_ids[rows] = prev.tokens[sources]
        hidden = self._forward(input_ids, positions, meta)
        flight = InFlight(out, started)
        sampled_entries = [i for i, s in enumerate(out.sample) if s]
        if not sampled_entries:  # chunks of prompts only
            flight.record(torch.empty(0, dtype=torch.long, device=self.device), None)
            return flight
        logits = self._logits(hidden, sample_idx)
        if any(not processes_beside_a_token_in_flight(out.requests[i].params) for i in fed):
            flight.logits = logits  # a grammar or bad_words reads prev's token on the host: sample_late
            return flight
        requests = out.sampled_requests
        # Processors (penalties, min_tokens) count a token in flight as an output: each entry's first input id.
        processed = bool(fed) and any(needs_processing(r.params) for r in requests)
        first_rows = to_device([firsts[i] for i in sampled_entries], self.device, torch.long) if processed else None
        tokens_in_flight = input_ids[first_rows] if first_rows is not None else None
        offsets = [int(out.in_flight_input(i)) for i in sampled_entries]  # seeded draws: the output position
        flight.record(*self.sampler.sample_on_device(logits, requests, offsets, tokens_in_flight))
        return flight

    @torch.inference_mode()
    def sample_late(self, flight: InFlight) -> None:
        """Samples a launched step that waited for the update of the step before it: every request's tokens are on
        the host now, as in a synchronous step."""
        assert flight.logits is not None
        requests = flight.sched.sampled_requests
        flight.record(*self.sampler.sample_on_device(flight.logits, requests, [0] * len(requests)))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> SampledTokens:
        input_ids, positions, meta, sample_idx = self._prepare(out)
        start = time.perf_counter()
        hidden = self._forward(input_ids, positions, meta)
        if wants_prompt_logprobs(out):
            score_prompts(self.model, hidden, out, self.vocab_size, self.padded_size)
        if self.pooling:
            return self._pool(hidden, out, sample_idx, start)
        # One sampled row per entry, or 1 + its drafts; each row's output position, for seeded draws.
        rows_of = [(r, i) for r, s in zip(out.requests, out.sample, strict=True) if s
                   for i in range(1 + len(r.draft_token_ids))]  # fmt: skip
        sampled_reqs, offsets = [r for r, _ in rows_of], [i for _, i in rows_of]
        if not sampled_reqs:
            self.last_forward_time = time.perf_counter() - start
            return SampledTokens([], [])
        logits = self._logits(hidden, sample_idx)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_forward_time = time.perf_counter() - start
        tokens, logprobs = self.sampler(logits, sampled_reqs, offsets)
        return SampledTokens(tokens, logprobs)

    def _pool(self, hidden: torch.Tensor, out: SchedulerOutput, sample_idx: list[int], start: float) -> SampledTokens:
        """A pooling engine's step (every request pools): each prompt that ends here leaves what its last position
        pools to (the hidden state, or a classifier's label logits) on its request, for its output
        (Scheduler.update). No token: max_tokens is 0."""
        if sample_idx:
            last = hidden[to_device(sample_idx, self.device, torch.long)]
            rows = self.model.lm_head.pool(last).cpu().numpy().astype("<f4")
            for req, row in zip(out.sampled_requests, rows, strict=True):
                req.pooled = row.tobytes()
        self.last_forward_time = time.perf_counter() - start
        return SampledTokens([], [])
