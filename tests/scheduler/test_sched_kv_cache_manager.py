"""KVCacheManager: prefix hits, the hit cap, allocation with no side effects on failure, freeing."""
from __future__ import annotations

import pytest

from scheduler import BlockHasher, KVCacheManager, Request, SamplingParams

BS = 4


def _req(rid: str, prompt: list[int], salt: str | None = None) -> Request:
    r = Request(rid, prompt, SamplingParams(), cache_salt=salt)
    r.set_block_hasher(BlockHasher(BS), BS)
    return r


def _compute(kvm: KVCacheManager, req: Request, n: int | None = None):
    """Allocate for n more tokens and mark them computed, as the scheduler does."""
    n = req.num_tokens - req.num_computed_tokens if n is None else n
    blocks = kvm.allocate_slots(req, n)
    assert blocks is not None
    req.num_computed_tokens += n
    return blocks


def _snapshot(kvm: KVCacheManager):
    pool = kvm.block_pool
    return (
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {h: sorted(d) for h, d in pool.cached_block_hash_to_block.items()},
        {r: [b.block_id for b in bl] for r, bl in kvm.req_to_blocks.items()},
        dict(kvm.num_cached_block), kvm.prefix_cache_queries, kvm.prefix_cache_hits,
    )


def test_partial_hit_and_only_full_blocks_cached() -> None:
    kvm = KVCacheManager(16, BS)
    a = _req("a", list(range(10)))
    _compute(kvm, a)
    blocks = kvm.req_to_blocks["a"]
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    b = _req("b", list(range(8)) + [99, 98, 97])
    hits, n = kvm.get_computed_blocks(b)
    assert n == 8 and hits == blocks[:2]
    assert (kvm.prefix_cache_queries, kvm.prefix_cache_hits) == (11, 8)


def test_full_prompt_hit_recomputes_last_block() -> None:
    kvm = KVCacheManager(16, BS)
    _compute(kvm, _req("a", list(range(12))))
    hits, n = kvm.get_computed_blocks(_req("b", list(range(12))))
    assert n == 8 and len(hits) == 2  # not 12: the last token must be computed for its logits
    hits, n = kvm.get_computed_blocks(_req("c", list(range(13))))
    assert n == 12


def test_salt_separates_tenants() -> None:
    kvm = KVCacheManager(16, BS)
    _compute(kvm, _req("a", list(range(9)), salt="t1"))
    assert kvm.get_computed_blocks(_req("b", list(range(9)), salt="t2"))[1] == 0
    assert kvm.get_computed_blocks(_req("c", list(range(9))))[1] == 0
    assert kvm.get_computed_blocks(_req("d", list(range(9)), salt="t1"))[1] == 8


def test_caching_off() -> None:
    kvm = KVCacheManager(16, BS, enable_caching=False)
    a = _req("a", list(range(9)))
    _compute(kvm, a)
    assert all(b.block_hash is None for b in kvm.block_pool.blocks)
    assert kvm.get_computed_blocks(_req("b", list(range(9)))) == ([], 0)


def test_blocks_cached_as_tokens_get_computed() -> None:
    kvm = KVCacheManager(16, BS)
    a = _req("a", list(range(6)))
    _compute(kvm, a, 3)
    assert all(b.block_hash is None for b in kvm.req_to_blocks["a"])
    _compute(kvm, a, 3)
    assert kvm.req_to_blocks["a"][0].block_hash == a.block_hashes[0]
    a.append_output_token_ids([6, 7])  # fills block 1; cached once computed
    assert kvm.req_to_blocks["a"][1].block_hash is None
    _compute(kvm, a)
    assert [b.block_hash for b in kvm.req_to_blocks["a"]] == a.block_hashes


def test_allocation_failure_changes_nothing() -> None:
    kvm = KVCacheManager(6, BS)  # 5 usable blocks
    a = _req("a", list(range(8)))
    _compute(kvm, a)
    kvm.free(a)  # 2 cached blocks now sit in the free queue
    held = _req("h", [50 + i for i in range(8)])
    _compute(kvm, held)  # takes 2 blocks (evicting nothing: fresh ones come first)
    assert kvm.block_pool.get_num_free_blocks() == 3
    before = _snapshot(kvm)
    big = _req("big", list(range(8)) + [7] * 12)  # 20 tokens: 2 hits + 3 new blocks
    hits, n = kvm.get_computed_blocks(big, record_stats=False)
    assert n == 8 and all(b.ref_cnt == 0 for b in hits)
    # 3 new + 2 evictable hits > 3 free: refused even though 3 new alone would fit
    assert kvm.allocate_slots(big, 12, n, hits) is None
    assert _snapshot(kvm) == before
    assert kvm.allocate_slots(_req("x", [1]), 17) is None  # 5 blocks > 3 free
    assert _snapshot(kvm) == before
    small = _req("small", list(range(8)) + [7] * 3)  # 2 hits + 1 new = 3
    assert kvm.allocate_slots(small, 3, n, hits) is not None
    assert [b.ref_cnt for b in hits] == [1, 1] and kvm.block_pool.get_num_free_blocks() == 0


def test_free_is_tail_first_and_hits_come_back() -> None:
    kvm = KVCacheManager(8, BS)
    a = _req("a", list(range(12)))
    _compute(kvm, a)
    ids = kvm.get_block_ids("a")
    kvm.free(a)
    assert [b.block_id for b in kvm.block_pool.free_block_queue.get_all_free_blocks()][-3:] == ids[::-1]
    assert kvm.get_block_ids("a") == [] and kvm.usage == 0.0
    b = _req("b", list(range(12)) + [1])
    hits, n = kvm.get_computed_blocks(b)
    assert [h.block_id for h in hits] == ids and n == 12


def test_free_uncache_drops_only_unshared_hashes() -> None:
    """free(uncache=True) (a failed step's request): its blocks nobody else holds lose their
    hashes, so no later request hits KV the failed step may not have written; a block shared
    with a live request keeps its hash (that request computed it)."""
    kvm = KVCacheManager(16, BS)
    a = _req("a", list(range(12)))
    _compute(kvm, a)
    b = _req("b", list(range(8)) + [99, 98, 97, 96, 95])
    hits, n = kvm.get_computed_blocks(b)
    assert n == 8
    kvm.allocate_slots(b, 5, n, hits)  # b shares a's first two blocks
    shared, private = kvm.req_to_blocks["b"][:2], kvm.req_to_blocks["b"][2:]
    kvm.free(b, uncache=True)
    assert all(x.block_hash is not None for x in shared)
    assert all(x.block_hash is None for x in private) and all(x.ref_cnt == 0 for x in private)
    kvm.free(a, uncache=True)
    assert not kvm.block_pool.cached_block_hash_to_block and kvm.usage == 0.0
    assert kvm.get_computed_blocks(_req("c", list(range(13)))) == ([], 0)


def test_lookahead_and_max_model_len_cap() -> None:
    kvm = KVCacheManager(32, BS, max_model_len=20)
    r = _req("r", list(range(5)))
    assert len(kvm.allocate_slots(r, 5, num_lookahead_tokens=4)) == 3  # 9 slots -> 3 blocks
    r2 = _req("r2", list(range(17)))
    assert len(kvm.allocate_slots(r2, 17, num_lookahead_tokens=8)) == 5  # capped at 20 slots
    assert kvm.usage == pytest.approx(8 / 31)
    with pytest.raises(ValueError, match="num_new_tokens"):
        kvm.allocate_slots(_req("z", [1]), -1)


def test_uncache_blocks_beyond_drops_only_uncomputed_private_blocks() -> None:
    kvm = KVCacheManager(16, BS)
    a = _req("a", list(range(12)))
    kvm.allocate_slots(a, 12)  # scheduled, num_computed_tokens still 0
    blocks = list(kvm.req_to_blocks["a"])
    assert all(b.block_hash is not None for b in blocks)
    kvm.uncache_blocks_beyond(a, 4)
    assert [b.block_hash is not None for b in blocks] == [True, False, False]
    assert len(kvm.block_pool.cached_block_hash_to_block) == 1


def test_reset_prefix_cache_and_bad_args() -> None:
    kvm = KVCacheManager(8, BS)
    a = _req("a", list(range(8)))
    _compute(kvm, a)
    assert kvm.reset_prefix_cache() is False
    kvm.free(a)
    assert kvm.reset_prefix_cache() is True
    assert kvm.get_computed_blocks(_req("b", list(range(9))))[1] == 0
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(8, 0)
    with pytest.raises(ValueError, match="hash_algo"):
        KVCacheManager(8, 4, hash_algo="md5")


def test_requests_without_a_hasher_get_one() -> None:
    """Direct users of the manager (no Scheduler) still get prefix caching."""
    kvm = KVCacheManager(8, BS)
    a = Request("a", list(range(8)), SamplingParams())
    kvm.allocate_slots(a, 8)
    kvm.free(a)
    assert a.block_hashes == _req("x", list(range(8))).block_hashes
    b = Request("b", list(range(9)), SamplingParams())
    assert kvm.get_computed_blocks(b)[1] == 8
