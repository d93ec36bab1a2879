"""Decode-only steps replayed from CUDA graphs: one launch per step instead of hundreds of small kernels.

A graph is captured per (batch size, block-table width) bucket the first time a decode step needs it, from
static input buffers that every later step of that bucket copies into. The batch is padded with dummy rows
(token 0 at position 0, writing its KV into the runner's scratch slot, attending to one key) and the table
width with stale but valid block ids, which the attention mask hides. Mixed steps with prefill run eagerly.

With `capture=False` the same buffers and buckets run eagerly, which is how the CPU tests check this logic.
"""

from __future__ import annotations

import torch

from engine_core.attention import AttentionMetadata


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 8, 8))
    return [b for b in sizes if b < max_batch] + [max_batch]


def width_bucket(width: int, max_width: int) -> int:
    """Block-table widths in powers of two, so a graph's attention reads no more than twice what it needs."""
    return min(1 << max(width - 1, 0).bit_length(), max_width)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_batch: int, max_blocks_per_seq: int, scratch_slot: int,
                 block_size: int, device: torch.device, capture: bool = True) -> None:  # fmt: skip
        self.model = model
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.max_width = max_blocks_per_seq
        self.scratch_slot = scratch_slot
        self.block_size = block_size
        self.capture = capture
        long = {"dtype": torch.long, "device": device}
        self.input_ids = torch.zeros(self.max_batch, **long)
        self.positions = torch.zeros(self.max_batch, **long)
        self.slots = torch.full((self.max_batch,), scratch_slot, **long)
        self.tables = torch.zeros(self.max_batch, max_blocks_per_seq, **long)
        self.seq_lens = torch.ones(self.max_batch, **long)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        self.pool = None  # one memory pool shared by all graphs: only one replays at a time

    def fits(self, num_decodes: int, meta: AttentionMetadata) -> bool:
        return 0 < num_decodes == meta.num_decodes and not meta.prefills and num_decodes <= self.max_batch

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [>= n, hidden] of the n decodes in meta (rows past n are padding)."""
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        n, width = meta.decode_block_tables.shape
        batch = next(b for b in self.buckets if b >= n)
        width = width_bucket(width, self.max_width)
        self.input_ids[:n].copy_(input_ids[:n])
        self.positions[:n].copy_(positions[:n])
        self.slots[:n].copy_(meta.slot_mapping[:n])
        self.tables[:n, : meta.decode_block_tables.shape[1]].copy_(meta.decode_block_tables)
        self.seq_lens[:n].copy_(meta.decode_seq_lens)
        # Rows n..batch may hold an earlier step's requests: make them dummies again.
        self.input_ids[n:batch].zero_()
        self.positions[n:batch].zero_()
        self.slots[n:batch].fill_(self.scratch_slot)
        self.seq_lens[n:batch].fill_(1)
        graph, hidden = self.graphs.get((batch, width)) or self._capture(batch, width)
        if graph is None:
            return self._forward(batch, width)
        graph.replay()
        return hidden

    def _forward(self, batch: int, width: int) -> torch.Tensor:
        meta = AttentionMetadata.build(self.slots[:batch], self.tables[:batch, :width], self.seq_lens[:batch], [],
                                       self.block_size)  # fmt: skip
        return self.model(self.input_ids[:batch], self.positions[:batch], meta)

    def _capture(self, batch: int, width: int) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor]:
        if not self.capture:
            entry = (None, torch.empty(0))
        else:
            self._forward(batch, width)  # warm-up outside the graph: lazy library initialisation, autotuning
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = self._forward(batch, width)
            self.pool = graph.pool()
            entry = (graph, hidden)
        self.graphs[batch, width] = entry
        return entry
