"""Tensor-parallel pieces of our models: how heads, columns and the vocabulary split over ranks, the layers that
communicate (row-parallel linear, vocab-parallel embedding, the LM head's gather), and checkpoint slicing.

Column-parallel layers (q/k/v, gate/up, GPT-2's c_attn and c_fc) need no layer of their own: they are plain
linears with fewer output rows, and the loader gives each rank its rows. With one rank everything here is the
identity, so the single-process path is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.model_errors import ConfigError
from engine_core import distributed


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when n items split as evenly as possible (the first parts take the rest)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


@dataclass(frozen=True)
class HeadSplit:
    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start


def head_split(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadSplit:
    """This rank's query and KV heads. KV heads are split (unevenly if need be) and each takes its query group
    along, so no KV head is stored twice; with fewer KV heads than ranks each KV head is replicated on the ranks
    that share its group."""
    if num_heads % num_kv_heads:
        raise ConfigError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv_start, kv_end = split(num_kv_heads, size, rank)
        return HeadSplit(kv_start * group, kv_end * group, kv_start, kv_end)
    ranks_per_kv = size // num_kv_heads
    if size % num_kv_heads or group % ranks_per_kv:
        raise ConfigError(f"{num_heads} query / {num_kv_heads} KV heads cannot be split over {size} ranks")
    per_rank = group // ranks_per_kv
    kv = rank // ranks_per_kv
    return HeadSplit(rank * per_rank, (rank + 1) * per_rank, kv, kv + 1)


def vocab_shard(vocab_size: int, size: int, rank: int) -> tuple[int, int, int]:
    """(start, end, padded rows): every rank holds ceil(vocab / size) rows, the last one zero-padded."""
    rows = -(-vocab_size // size)
    start = min(rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


def take_rows(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return t[start:end]


def take_cols(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return t[:, start:end] if t.dim() == 2 else t  # a row-parallel bias is whole on every rank


def take_vocab_rows(t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    size, rank = distributed.tp_size(), distributed.tp_rank()
    start, end, rows = vocab_shard(vocab_size, size, rank)
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: end - start] = t[start:end]
    return out


class RowParallelLinear(nn.Linear):
    """Input columns split over ranks: each computes a partial sum, all-reduced; the bias is added once, after."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if distributed.tp_size() == 1:
            return super().forward(x)
        out = distributed.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds a slice of the vocabulary's rows; ids outside it contribute zeros to the all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.vocab_size = vocab_size
        size, rank = distributed.tp_size(), distributed.tp_rank()
        self.vocab_start, self.vocab_end, rows = vocab_shard(vocab_size, size, rank)
        super().__init__(rows, hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if distributed.tp_size() == 1:
            return super().forward(ids)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        out = F.embedding((ids - self.vocab_start) * mine, self.weight)
        return distributed.all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


def lm_head_rows(vocab_size: int) -> int:
    """Output rows of this rank's LM head (the same padded slice as the embedding, so tied weights match)."""
    return vocab_shard(vocab_size, distributed.tp_size(), distributed.tp_rank())[2]


def vocab_logits(lm_head: nn.Module, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The LM head over `hidden`. With several ranks, rank 0 first tells the workers which rows (they compute
    their vocabulary slice of the same rows and join the gather); rank 0 returns [rows, vocab], the others their
    own [rows, padded slice]."""
    if distributed.tp_size() == 1:
        return lm_head(hidden)
    with distributed.lockstep():
        if distributed.tp_rank() == 0:
            distributed.announce_logits(hidden)
        local = lm_head(hidden)
        full = distributed.gather_to_leader(local)
        return local if full is None else full[:, :vocab_size]
