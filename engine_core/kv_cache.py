"""KV block bookkeeping: a ref-counted BlockPool with an LRU free queue, and automatic prefix caching.

The tensors themselves live in the model runner; this file only decides which block holds what.
A full block is identified by a hash chained over its parent's hash and its key: its token ids and how many of
them are prompt positions (which ran through the prefill kernel; the rest ran as decode rows). So a hit means the
whole prefix matches and each position was computed by the kernel the new request would use: a request whose prompt
holds an earlier answer (a multi-turn chat) prefills that answer's blocks again instead of taking decode-made K/V.
The key also names the LoRA adapter that served the request (another adapter's K/V of the same tokens is another K/V)
and the request's cache_salt (a tenant's secret: nobody without it can tell from a hit's speed what it asked). The
key is compared too, so a hash collision is a miss.
"""

from __future__ import annotations

from collections import OrderedDict

from engine_core.request import Request

# (the LoRA adapter that computed it, the request's cache_salt, prompt positions in the block, its token ids)
BlockKey = tuple[int, str, int, tuple[int, ...]]


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.key: BlockKey | None = None


def chain_hash(parent: int | None, key: BlockKey) -> int:
    return hash((parent, key))


class BlockPool:
    """Free blocks wait in LRU order; a freed block keeps its hash until it is reused, so it can still hit."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> Block:
        block = self.blocks[self.free.popitem(last=False)[0]]
        if block.block_hash is not None:  # evict the least recently used cached block
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            block.block_hash, block.key = None, None
        block.ref_count = 1
        return block

    def touch(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free[block.block_id]
        block.ref_count += 1

    def release(self, block: Block) -> None:
        block.ref_count -= 1
        assert block.ref_count >= 0, "block freed twice"
        if block.ref_count == 0:
            self.free[block.block_id] = None

    def lookup(self, block_hash: int, key: BlockKey) -> Block | None:
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.key == key else None

    def register(self, block: Block, block_hash: int, key: BlockKey) -> None:
        block.block_hash, block.key = block_hash, key
        self.cached.setdefault(block_hash, block.block_id)  # keep the first copy of a duplicate

    def reset_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        self.cached.clear()
        for block in self.blocks:
            block.block_hash, block.key = None, None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def _block_key(self, req: Request, index: int) -> BlockKey:
        start = index * self.block_size
        num_prompt = min(max(req.num_prompt_tokens - start, 0), self.block_size)
        return req.lora_slot, req.cache_salt, num_prompt, tuple(req.token_ids[start : start + self.block_size])

    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
        """Hashes every full block within the first num_tokens tokens that has none yet."""
        for i in range(len(req.block_hashes), num_tokens // self.block_size):
            parent = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes.append(chain_hash(parent, self._block_key(req, i)))

    def get_computed_blocks(self, req: Request) -> list[Block]:
        """The longest cached prefix of a request that holds no blocks. At least one token is left to
        compute, since the last position must run through the model to give logits."""
        if not self.enable_prefix_caching:
            return []
        self._extend_hashes(req, req.num_tokens - 1)
        hits: list[Block] = []
        for i, block_hash in enumerate(req.block_hashes[: (req.num_tokens - 1) // self.block_size]):
            block = self.pool.lookup(block_hash, self._block_key(req, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def _blocks_needed(self, req: Request, num_new_tokens: int, computed: list[Block]) -> int:
        """New blocks that num_new_tokens more tokens take after the `computed` prefix hits (<= 0: none)."""
        num_computed = req.num_computed_tokens + len(computed) * self.block_size
        return -(-(num_computed + num_new_tokens) // self.block_size) - len(req.block_ids) - len(computed)

    def _free_beside(self, computed: list[Block]) -> int:
        """Free blocks left to allocate from once the `computed` hits are taken (those in the free queue leave it)."""
        return self.pool.num_free - sum(1 for b in computed if b.ref_count == 0)

    def can_allocate(self, req: Request, num_new_tokens: int, computed: list[Block]) -> bool:
        """Whether allocate_slots would succeed, changing nothing."""
        return self._blocks_needed(req, num_new_tokens, computed) <= self._free_beside(computed)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[Block] | None = None) -> bool:
        """Makes room for num_new_tokens more tokens (after the `computed` prefix hits, which become the
        request's first blocks). False, with nothing changed, if the pool cannot cover it."""
        computed = computed or []
        needed = self._blocks_needed(req, num_new_tokens, computed)
        if needed <= 0 and not computed:  # most decode steps: the last block has room
            return True
        if needed > self._free_beside(computed):
            return False
        for block in computed:
            self.pool.touch(block)
        req.block_ids.extend(b.block_id for b in computed)
        req.num_computed_tokens += len(computed) * self.block_size
        # A recompute's hits may cover its own outputs; only prompt tokens count as cached.
        hit = min(len(computed) * self.block_size, req.num_prompt_tokens)
        req.num_cached_tokens = max(req.num_cached_tokens, hit)
        req.block_ids.extend(self.pool.allocate().block_id for _ in range(needed))
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Registers the request's blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        self._extend_hashes(req, num_full * self.block_size)
        for i in range(req.num_registered_blocks, num_full):
            block = self.pool.blocks[req.block_ids[i]]
            if block.block_hash is None:
                self.pool.register(block, req.block_hashes[i], self._block_key(req, i))
        req.num_registered_blocks = max(req.num_registered_blocks, num_full)

    def free(self, req: Request) -> None:
        # Tail blocks first, so the least shared ones are evicted first.
        for block_id in reversed(req.block_ids):
            self.pool.release(self.pool.blocks[block_id])
        req.block_ids = []
        req.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()

    def check_integrity(self, live: list[Request]) -> None:
        """Free + in use == total, and every ref count equals the number of live holders."""
        refs = [0] * self.num_blocks
        for req in live:
            for block_id in req.block_ids:
                refs[block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id} refs mismatch"
            assert (block.ref_count == 0) == (block.block_id in self.pool.free), f"block {block.block_id} queue"
        assert self.num_free_blocks + sum(1 for r in refs if r) == self.num_blocks
