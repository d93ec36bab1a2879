"""Decode-only steps replayed from CUDA graphs: one launch per step instead of hundreds of small kernels.

One graph per batch-size bucket, all captured at engine start (largest first, sharing one memory pool), from
static input buffers that every later step copies into. Block tables have one fixed width, enough for
max_model_len, so no step ever needs another graph; only a backend whose cost does not grow with that width
(Triton: it reads ceil(seq_len / block_size) blocks) is graphed. Padding rows of a bucket have seq_len 0 and write
their KV into the runner's scratch slot: the attention reads nothing for them. A step with prefill rows that fits
the largest bucket runs them as decode rows (ModelRunner._prepare); a larger one runs eagerly.

With `capture=False` the same buffers and buckets run eagerly, which is how the CPU tests check this logic.
"""

from __future__ import annotations

import gc
import logging
import time

import torch

from common.config import EngineConfig
from engine_core.attention import AttentionMetadata
from engine_core.batch import SchedulerOutput

log = logging.getLogger("roseinfer.cuda_graphs")


# Rows of the largest graph when the step budget allows (--mixed-step-graphs): a step of a few hundred decodes plus
# the prompt of a request that just arrived replays a graph, its prompt tokens as decode rows.
MIXED_GRAPH_ROWS = 1024
# K/V bytes the prompt tokens of such a step may read as decode rows, each its whole context (a prefill reads each
# block once per query tile): about 0.5 ms of an H100's bandwidth. A long chunk, or one after a long cached prefix,
# runs eagerly instead.
PROMPT_ROWS_KV_BYTES = 2 * 2**30


def graph_rows(config: EngineConfig) -> int:
    assert config.max_num_batched_tokens is not None
    if not config.mixed_step_graphs:
        return config.max_num_seqs
    return max(config.max_num_seqs, min(config.max_num_batched_tokens, MIXED_GRAPH_ROWS))


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to 256 and of 64 beyond, up to max_batch."""
    sizes = [1, 2, 4, *range(8, 257, 8), *range(320, max_batch + 64, 64)]
    return [b for b in sizes if b < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_batch: int, max_blocks_per_seq: int, scratch_slot: int,
                 block_size: int, device: torch.device, index_dtype: torch.dtype = torch.long,
                 capture: bool = True, mixed: bool = True) -> None:  # fmt: skip
        self.model = model
        self.mixed = mixed  # --mixed-step-graphs: steps with prompt tokens that fit replay too
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.width = max_blocks_per_seq  # ceil(max_model_len / block_size): every graph's table width
        self.scratch_slot = scratch_slot
        self.block_size = block_size
        self.capture = capture
        long = {"dtype": torch.long, "device": device}
        self.input_ids = torch.zeros(self.max_batch, **long)
        self.positions = torch.zeros(self.max_batch, **long)
        self.slots = torch.full((self.max_batch,), scratch_slot, **long)
        self.tables = torch.zeros(self.max_batch, self.width, dtype=index_dtype, device=device)
        self.seq_lens = torch.zeros(self.max_batch, dtype=index_dtype, device=device)
        # batch -> (graph, its output buffer); graph None with capture=False (run eagerly)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        self.pool = None  # one memory pool shared by all graphs: only one replays at a time

    def bucket(self, num_decodes: int) -> int:
        return next(b for b in self.buckets if b >= num_decodes)

    def takes_prompts(self, out: SchedulerOutput, kv_bytes_per_token: int) -> bool:
        """Whether the step's prompt tokens go in as decode rows (ModelRunner._prepare), so that it replays a graph:
        it fits the largest one, and its prompt rows read at most PROMPT_ROWS_KV_BYTES of K/V."""
        if not self.mixed or out.total_tokens > self.max_batch:
            return False
        # Row p of a chunk starting at s reads p + 1 tokens' K/V: n * s + n * (n + 1) / 2 for the chunk.
        reads = sum(n * out.start(i) + n * (n + 1) // 2 for i, n in enumerate(out.num_new_tokens) if not out.decodes(i))
        return reads * kv_bytes_per_token <= PROMPT_ROWS_KV_BYTES

    def fits(self, num_decodes: int, meta: AttentionMetadata) -> bool:
        return 0 < num_decodes == meta.num_decodes and not meta.prefills and num_decodes <= self.max_batch

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [>= n, hidden] of the n decodes in meta (rows past n are padding)."""
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        n, width = meta.decode_block_tables.shape
        batch = self.bucket(n)
        self.input_ids[:n].copy_(input_ids[:n])
        self.positions[:n].copy_(positions[:n])
        self.slots[:n].copy_(meta.slot_mapping[:n])
        # Columns past `width` keep stale block ids: valid indices that no sequence's length reaches.
        self.tables[:n, :width].copy_(meta.decode_block_tables)
        self.seq_lens[:n].copy_(meta.decode_seq_lens)
        # Rows n..batch may hold an earlier step's requests: make them padding again.
        self.input_ids[n:batch].zero_()
        self.positions[n:batch].zero_()
        self.slots[n:batch].fill_(self.scratch_slot)
        self.seq_lens[n:batch].zero_()
        graph, hidden = self.graphs[batch]
        if graph is None:
            return self._forward(batch)
        graph.replay()
        return hidden

    def capture_all(self) -> None:
        """Every bucket, largest first: the smaller graphs then fit in the pool the largest one allocated."""
        start = time.perf_counter()
        self.seq_lens.zero_()  # capture with padding rows only: nothing is read
        # A graph that the collector frees mid-capture (an earlier engine's, in the same process) releases device
        # memory, which invalidates the capture: collect first, then hold the collector off until the last graph.
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        if self.capture:  # torch.cuda.graph empties the allocator cache anyway: first, to count the graphs alone
            torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info()[0] if self.capture else 0
        try:
            for i, batch in enumerate(sorted(self.buckets, reverse=True), 1):
                self.graphs[batch] = self._capture(batch)
                if self.capture and (i % 8 == 0 or i == len(self.buckets)):
                    log.info("capturing CUDA graphs: %d/%d batch sizes", i, len(self.buckets))
        finally:
            if collecting:
                gc.enable()
        if self.capture:
            used, took = free_before - torch.cuda.mem_get_info()[0], time.perf_counter() - start
            log.info("captured %d CUDA graphs (batch sizes up to %d, table width %d) in %.1f s, %.0f MiB",
                     len(self.graphs), self.max_batch, self.width, took, used / 2**20)  # fmt: skip

    def _forward(self, batch: int) -> torch.Tensor:
        meta = AttentionMetadata.build(self.slots[:batch], self.tables[:batch], self.seq_lens[:batch], [],
                                       self.block_size)  # fmt: skip
        return self.model(self.input_ids[:batch], self.positions[:batch], meta)

    @torch.inference_mode()
    def _capture(self, batch: int) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor]:
        if not self.capture:
            return None, torch.empty(0)
        self._forward(batch)  # warm-up outside the graph: lazy library initialisation, Triton compilation
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._forward(batch)
        self.pool = graph.pool()
        return graph, hidden
