"""Per-step attention metadata: built once per step by the model runner, read by every layer's backend.

The flat batch of a step holds the decode rows first, then the prefill chunks (contiguous rows), then
padding rows that nobody attends and whose output is zero. What only one backend needs (kernel argument arrays,
int32 copies, masks) is built on that backend's first use in the step and cached here, so the CPU step pays for
nothing the Triton backend wants and vice versa.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from engine_core.transfer import to_device

T = TypeVar("T")


@dataclass
class PrefillChunk:
    start: int  # first token of this chunk in the flat batch
    num_tokens: int  # query length
    context_len: int  # tokens in the cache after this chunk (cached prefix + earlier chunks + this chunk)
    block_ids: torch.Tensor  # the blocks covering context_len tokens


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every token in the flat batch
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [D, W]; a CUDA graph's are wider than needed
    decode_seq_lens: torch.Tensor | None = None  # [D] keys incl. the new token; 0 for a graph's padding rows
    prefills: list[PrefillChunk] = field(default_factory=list)
    block_size: int = 16
    extras: dict[str, Any] = field(default_factory=dict)  # per-backend tensors of this step, see cached()

    @staticmethod
    def build(
        slot_mapping: torch.Tensor,
        decode_block_tables: torch.Tensor | None,
        decode_seq_lens: torch.Tensor | None,
        prefills: list[PrefillChunk],
        block_size: int,
    ) -> AttentionMetadata:
        num_decodes = 0 if decode_block_tables is None else decode_block_tables.shape[0]
        return AttentionMetadata(slot_mapping, num_decodes, decode_block_tables, decode_seq_lens, prefills, block_size)

    def cached(self, key: str, build: Callable[[AttentionMetadata], T]) -> T:
        """build(self) on the first call with this key in the step (the first layer), its result afterwards."""
        value = self.extras.get(key)
        if value is None:
            value = self.extras[key] = build(self)
        return value

    # ---- prefill chunks as kernel arrays (varlen layout) ----

    @property
    def prefill_rows(self) -> tuple[int, int]:
        """(first, end) rows of the prefill chunks in the flat batch; (n, n) without chunks."""
        if not self.prefills:
            return self.num_decodes, self.num_decodes
        last = self.prefills[-1]
        return self.prefills[0].start, last.start + last.num_tokens

    def query_start_loc(self, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """cu_seqlens_q [C+1]: chunk c's queries are rows [c]:[c+1], relative to the first prefill row."""
        first = self.prefill_rows[0]
        starts = [c.start - first for c in self.prefills] + [self.prefill_rows[1] - first]
        return to_device(starts, self.slot_mapping.device, dtype)

    def context_lens(self, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """[C] keys in the cache after each chunk."""
        return to_device([c.context_len for c in self.prefills], self.slot_mapping.device, dtype)

    def prefill_block_tables(self, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """[C, W] the chunks' block tables, zero-padded to the widest."""
        tables = torch.nn.utils.rnn.pad_sequence([c.block_ids for c in self.prefills], batch_first=True)
        return tables.to(dtype)
