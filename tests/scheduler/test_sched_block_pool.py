"""KVCacheBlock, FreeKVCacheBlockQueue and BlockPool: order, O(1) links, lazy eviction."""
from __future__ import annotations

import pytest

from scheduler import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_block_has_slots_and_contract_fields() -> None:
    b = KVCacheBlock(3)
    assert (b.block_id, b.ref_cnt, b.block_hash, b.prev_free_block, b.next_free_block, b.is_null) == \
        (3, 0, None, None, None, False)
    with pytest.raises(AttributeError):
        b.something_else = 1  # __slots__: no per-block dict


def test_free_queue_basic_ops() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 6 and _ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    assert q.popleft() is blocks[0]
    q.remove(blocks[3])  # from the middle
    assert _ids(q.get_all_free_blocks()) == [1, 2, 4, 5]
    q.append(blocks[3])
    q.append(blocks[0])
    assert _ids(q.get_all_free_blocks()) == [1, 2, 4, 5, 3, 0]
    assert _ids(q.popleft_n(3)) == [1, 2, 4]
    q.append_n([blocks[1], blocks[2]])
    assert _ids(q.get_all_free_blocks()) == [5, 3, 0, 1, 2] and q.num_free_blocks == 5
    assert q.popleft_n(0) == []
    with pytest.raises(ValueError):
        q.popleft_n(6)
    assert q.num_free_blocks == 5  # a refused popleft_n changes nothing
    q.popleft_n(5)
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.remove(blocks[0])  # not in the queue
    q.append(blocks[0])
    with pytest.raises(ValueError):
        q.append(blocks[0])  # already in the queue


def test_fresh_pool_null_block_and_order() -> None:
    pool = BlockPool(8)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == list(range(1, 8))
    assert pool.get_num_free_blocks() == 7 and pool.get_usage() == 0.0
    got = pool.get_new_blocks(3)
    assert _ids(got) == [1, 2, 3] and all(b.ref_cnt == 1 for b in got)
    assert pool.get_usage() == pytest.approx(3 / 7)
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)
    pool.get_new_blocks(4)
    assert pool.null_block.ref_cnt == 0 and pool.get_num_free_blocks() == 0


def test_freed_blocks_go_to_tail_lru_first() -> None:
    pool = BlockPool(7)
    a = pool.get_new_blocks(3)  # 1 2 3
    b = pool.get_new_blocks(2)  # 4 5
    pool.free_blocks(reversed(a))  # request a finishes first, tail first
    pool.free_blocks(reversed(b))
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [6, 3, 2, 1, 5, 4]
    # reuse takes the never-used block, then a's tail, then a's head, ...
    assert _ids(pool.get_new_blocks(4)) == [6, 3, 2, 1]


def test_shared_block_returns_to_queue_only_at_zero_refs() -> None:
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and blk not in pool.free_block_queue.get_all_free_blocks()
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and pool.free_block_queue.get_all_free_blocks()[-1] is blk
    with pytest.raises(ValueError):
        pool.free_blocks([blk])  # double free


def test_cached_free_block_keeps_hash_until_popped_and_touch_is_o1_removal() -> None:
    pool = BlockPool(5)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_block(b1, b"h1")
    pool.cache_block(b2, b"h2")
    pool.free_blocks([b2, b1])
    assert pool.get_cached_block(b"h1") is b1 and b1.block_hash == b"h1"  # still hittable
    pool.touch([b1])  # a hit pulls it out of the free queue
    assert b1.ref_cnt == 1 and b1 not in pool.free_block_queue.get_all_free_blocks()
    assert pool.get_num_free_blocks() == 3
    got = pool.get_new_blocks(3)  # 3, 4, then b2 is evicted lazily
    assert got[-1] is b2 and b2.block_hash is None and pool.get_cached_block(b"h2") is None
    assert pool.get_cached_block(b"h1") is b1


def test_duplicate_hashes_and_uncache_one() -> None:
    pool = BlockPool(4)
    x, y = pool.get_new_blocks(2)
    pool.cache_block(x, b"same")
    pool.cache_block(y, b"same")
    assert pool.get_cached_block(b"same") in (x, y)
    pool.uncache_block(x)
    assert pool.get_cached_block(b"same") is y and x.block_hash is None
    pool.uncache_block(y)
    assert pool.get_cached_block(b"same") is None and b"same" not in pool.cached_block_hash_to_block


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, b"h")
    assert pool.reset_prefix_cache() is False and b.block_hash == b"h"
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert b.block_hash is None and pool.get_cached_block(b"h") is None


def test_pool_rejects_bad_sizes() -> None:
    for n in (0, 1, 2.0, True):
        with pytest.raises(ValueError, match="num_blocks"):
            BlockPool(n)
