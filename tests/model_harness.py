"""Drives one of our models over a paged KV cache without the engine, for model-level parity tests."""

from __future__ import annotations

import torch

from engine_core.attention import AttentionBackend, AttentionMetadata, PrefillChunk, select_backend

BLOCK_SIZE = 4  # small blocks so that every test crosses block boundaries


class PagedRun:
    """Each sequence gets its own contiguous run of blocks; enough for max_len tokens. The attention backend is the
    engine's automatic choice unless one is given."""

    def __init__(self, model, num_seqs: int, max_len: int, dtype=torch.float32,
                 backend: AttentionBackend | None = None, kv_dtype: torch.dtype | None = None,
                 block_size: int = BLOCK_SIZE) -> None:  # fmt: skip
        self.model, self.block_size = model, block_size
        self.blocks_per_seq = (max_len + self.block_size - 1) // self.block_size
        num_blocks = num_seqs * self.blocks_per_seq + 1  # the last one: padding rows' scratch block
        self.scratch_slot = (num_blocks - 1) * self.block_size
        shape = (num_blocks, self.block_size, model.num_kv_heads, model.head_dim)
        attn = model.attention_layers()[0]
        kv_dtype = kv_dtype or dtype  # the caches' (an fp8 KV cache: torch.float8_e4m3fn)
        self.backend = backend or select_backend("auto", torch.device("cpu"), dtype, attn.num_heads,
                                                 attn.num_kv_heads, attn.head_dim, block_size, kv_dtype)  # fmt: skip
        for layer in model.attention_layers():
            layer.k_cache = torch.zeros(shape, dtype=kv_dtype)
            layer.v_cache = torch.zeros(shape, dtype=kv_dtype)
            layer.attn_backend = self.backend
        # Interleave the blocks of different sequences so that block tables are not trivial.
        self.tables = [
            torch.arange(self.blocks_per_seq) * num_seqs + i for i in range(num_seqs)
        ]
        self.lens = [0] * num_seqs

    def _slots(self, seq: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return self.tables[seq][pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.inference_mode()
    def prefill(self, chunks: list[list[int]], seqs: list[int] | None = None) -> list[torch.Tensor]:
        """Feeds a chunk of tokens to each given sequence in one flat forward; returns per-token logits."""
        seqs = list(range(len(chunks))) if seqs is None else seqs
        ids, pos, slots, prefills, start = [], [], [], [], 0
        for seq, chunk in zip(seqs, chunks, strict=True):
            s, e = self.lens[seq], self.lens[seq] + len(chunk)
            ids += chunk
            pos += list(range(s, e))
            slots.append(self._slots(seq, s, e))
            nblocks = (e + self.block_size - 1) // self.block_size
            prefills.append(PrefillChunk(start, len(chunk), e, self.tables[seq][:nblocks]))
            start += len(chunk)
            self.lens[seq] = e
        meta = AttentionMetadata.build(torch.cat(slots), None, None, prefills, self.block_size)
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), meta)
        logits = self.model.compute_logits(hidden)
        return list(logits.split([len(c) for c in chunks]))

    @torch.inference_mode()
    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One token for every sequence, through the batched decode path; returns [num_seqs, vocab]."""
        n = len(tokens)
        pos = torch.tensor(self.lens[:n])
        slots = torch.cat([self._slots(i, self.lens[i], self.lens[i] + 1) for i in range(n)])
        self.lens[:n] = [x + 1 for x in self.lens[:n]]
        max_blocks = max((x + self.block_size - 1) // self.block_size for x in self.lens[:n])
        tables = torch.stack([t[:max_blocks] for t in self.tables[:n]])
        meta = AttentionMetadata.build(slots, tables, torch.tensor(self.lens[:n]), [], self.block_size)
        return self.model.compute_logits(self.model(torch.tensor(tokens), pos, meta))

    @torch.inference_mode()
    def mixed(self, tokens: list[int], chunks: list[list[int]], seqs: list[int], pad: int = 0) -> torch.Tensor:
        """One step as the engine flattens it: a decode for each of the first len(tokens) sequences, then a prefill
        chunk for each of `seqs` (after whatever they hold already), then `pad` padding rows writing to the scratch
        slot. Returns the logits of every row [rows, vocab]."""
        n = len(tokens)
        slots = [self._slots(i, self.lens[i], self.lens[i] + 1) for i in range(n)]
        pos = self.lens[:n]
        self.lens[:n] = [x + 1 for x in self.lens[:n]]
        ids, prefills, start = list(tokens), [], n
        for seq, chunk in zip(seqs, chunks, strict=True):
            s, e = self.lens[seq], self.lens[seq] + len(chunk)
            ids += chunk
            pos += range(s, e)
            slots.append(self._slots(seq, s, e))
            prefills.append(PrefillChunk(start, len(chunk), e, self.tables[seq][: -(-e // self.block_size)]))
            start, self.lens[seq] = start + len(chunk), e
        slots.append(torch.full((pad,), self.scratch_slot))
        tables = lens = None
        if n:
            width = max(-(-x // self.block_size) for x in self.lens[:n])
            tables, lens = torch.stack([t[:width] for t in self.tables[:n]]), torch.tensor(self.lens[:n])
        meta = AttentionMetadata.build(torch.cat(slots), tables, lens, prefills, self.block_size)
        hidden = self.model(torch.tensor(ids + [0] * pad), torch.tensor(pos + [0] * pad), meta)
        return self.model.compute_logits(hidden)
