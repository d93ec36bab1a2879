"""BlockPool / KVCacheManager: ref counts, LRU eviction, prefix hits, and the integrity invariant."""

from __future__ import annotations

from common.messages import EngineRequest, SamplingParams
from engine_core.kv_cache import KVCacheManager
from engine_core.request import Request

BS = 4


def make(rid: str, tokens: list[int]) -> Request:
    return Request(EngineRequest(rid, tokens, SamplingParams(max_tokens=8)), seq_no=0)


def compute_all(kv: KVCacheManager, req: Request) -> None:
    """What the scheduler does for a whole prompt in one step."""
    hits = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - len(hits) * BS, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)


def test_allocate_free_keeps_totals() -> None:
    kv = KVCacheManager(10, BS, enable_prefix_caching=True)
    a, b = make("a", list(range(9))), make("b", list(range(100, 103)))
    compute_all(kv, a)
    compute_all(kv, b)
    assert len(a.block_ids) == 3 and len(b.block_ids) == 1
    assert kv.num_used_blocks == 4
    kv.check_integrity([a, b])
    kv.free(a)
    kv.free(b)
    kv.check_integrity([])
    assert kv.num_free_blocks == 10


def test_prefix_hit_shares_blocks_and_checks_tokens() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = make("a", list(range(13)))
    compute_all(kv, a)
    b = make("b", list(range(12)) + [99, 98])
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == a.block_ids[:3]
    assert kv.allocate_slots(b, b.num_tokens - 12, hits)
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert kv.pool.blocks[a.block_ids[0]].ref_count == 2
    kv.check_integrity([a, b])
    # Same hash chain but different tokens in a block must not hit: change one token of block 2.
    c = make("c", list(range(8)) + [7, 9, 10, 11, 12])
    assert len(kv.get_computed_blocks(c)) == 2


def test_full_prompt_hit_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = make("a", list(range(8)))
    compute_all(kv, a)
    b = make("b", list(range(8)))
    assert len(kv.get_computed_blocks(b)) == 1  # the second block holds the last token: recomputed


def test_freed_blocks_stay_cached_until_evicted_lru() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = make("a", list(range(9)))
    compute_all(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make("b", list(range(9)))
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2  # still cached after free
    assert kv.allocate_slots(b, 1, hits)
    kv.check_integrity([b])
    kv.free(b)
    # Fill the pool with unrelated tokens: the old blocks are evicted and stop hitting.
    c = make("c", list(range(50, 66)))
    compute_all(kv, c)
    assert kv.get_computed_blocks(make("d", list(range(9)))) == []
    kv.free(c)
    kv.check_integrity([])


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(3, BS, enable_prefix_caching=True)
    a = make("a", list(range(8)))
    compute_all(kv, a)
    big = make("big", list(range(20, 40)))
    assert not kv.allocate_slots(big, 20)
    assert big.block_ids == [] and kv.num_used_blocks == 2
    kv.check_integrity([a])


def test_can_allocate_answers_what_allocate_slots_would_do() -> None:
    """With hits in use by another request and hits in the free queue (which allocating takes from it): the answer
    at each size is allocate_slots' own, and asking changes nothing."""
    for size in range(1, 40):
        kv = KVCacheManager(8, BS, enable_prefix_caching=True)
        held, freed = make("held", list(range(8))), make("freed", list(range(8)) + list(range(50, 58)))
        compute_all(kv, held)
        compute_all(kv, freed)
        kv.free(freed)  # its last two blocks go to the free queue, still cached
        req = make("r", list(range(8)) + list(range(50, 58)) + list(range(90, 90 + size)))
        hits = kv.get_computed_blocks(req)
        assert len(hits) == 4
        used, free = kv.num_used_blocks, kv.num_free_blocks
        answer = kv.can_allocate(req, size, hits)
        assert (kv.num_used_blocks, kv.num_free_blocks, req.block_ids) == (used, free, [])
        assert kv.allocate_slots(req, size, hits) == answer, size
        assert answer == (size <= 4 * BS), size  # 8 blocks: 4 of hits, 4 free for new tokens
        kv.check_integrity([held, req] if answer else [held])


def test_prefix_caching_off_never_hits() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = make("a", list(range(9)))
    compute_all(kv, a)
    assert kv.get_computed_blocks(make("b", list(range(9)))) == []


def test_reset_prefix_cache_forgets_hashes() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make("a", list(range(9)))
    compute_all(kv, a)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make("b", list(range(9)))) == []
    kv.check_integrity([])


def decode(kv: KVCacheManager, req: Request, tokens: list[int]) -> None:
    """What the scheduler does for outputs: one position at a time, each a decode row."""
    for token in tokens:
        assert kv.allocate_slots(req, 1)
        req.token_ids.append(token)
        req.num_computed_tokens += 1
        kv.cache_full_blocks(req)


def test_a_block_hits_only_where_its_positions_ran_through_the_same_kernel() -> None:
    """Prompt positions are prefilled and outputs decoded, and the two kernels round differently, so a block is
    keyed by its tokens and how many of them are prompt. `a`: 10 prompt tokens, 7 outputs, so block 2 holds 2
    prompt positions and 2 outputs, block 3 only outputs."""
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = make("a", list(range(10)))
    compute_all(kv, a)
    decode(kv, a, list(range(50, 57)))
    assert a.num_registered_blocks == 4
    # The next turn of a chat: a's prompt and answer, then more. Only the blocks wholly in a's prompt hit.
    turn = make("turn", [*a.token_ids, 99, 98])
    assert [b.block_id for b in kv.get_computed_blocks(turn)] == a.block_ids[:2]
    # A recompute of a (preempted, or resumed after a restart) takes all four: the same kernels made each.
    again = Request(EngineRequest("again", list(range(10)), SamplingParams(max_tokens=8),
                                  output_token_ids=list(range(50, 57))), seq_no=1)  # fmt: skip
    assert [b.block_id for b in kv.get_computed_blocks(again)] == a.block_ids[:4]
    # The reverse: blocks another request prefilled as prompt do not serve a recompute's output positions.
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    long = make("long", [*range(10), *range(50, 57)])
    compute_all(kv, long)
    assert [b.block_id for b in kv.get_computed_blocks(again)] == long.block_ids[:2]
    kv.check_integrity([long])
