"""The block pool on its own: the intrusive free queue, reference counts, the hash map."""
from __future__ import annotations

import random
import time

import pytest

from batchinfer.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


# ---- FreeBlockQueue ---------------------------------------------------------------------

def test_queue_keeps_insertion_order_and_pops_from_head():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.size == 5
    assert [b.block_id for b in queue] == [0, 1, 2, 3, 4]
    assert queue.popleft() is blocks[0]
    assert queue.popleft() is blocks[1]
    assert [b.block_id for b in queue] == [2, 3, 4]
    assert queue.size == 3


def test_queue_remove_head_middle_tail_then_append():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert [b.block_id for b in queue] == [1, 3]
    assert queue.size == 2
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 2, 0]
    assert [queue.popleft().block_id for _ in range(4)] == [1, 3, 2, 0]
    assert queue.size == 0
    with pytest.raises(RuntimeError, match="no free KV blocks"):
        queue.popleft()


def test_queue_operations_are_constant_time():
    """Removing every block of a large queue in random order, then re-appending them,
    must not walk the list: 40k removals from an O(n) list would take minutes."""
    n = 40_000
    blocks = [KVBlock(i) for i in range(n)]
    queue = FreeBlockQueue(blocks)
    order = list(range(n))
    random.Random(0).shuffle(order)
    start = time.perf_counter()
    for i in order:
        queue.remove(blocks[i])
    for i in order:
        queue.append(blocks[i])
    elapsed = time.perf_counter() - start
    assert queue.size == n
    assert [b.block_id for b in queue] == order
    assert elapsed < 2.0, f"{2 * n} queue operations took {elapsed:.2f} s"


# ---- BlockPool --------------------------------------------------------------------------

def test_allocate_takes_blocks_from_the_head_with_one_reference():
    pool = BlockPool(6, enable_caching=True)
    got = pool.allocate(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 3
    assert free_ids(pool) == [3, 4, 5]


def test_allocate_more_than_free_raises_and_takes_nothing():
    pool = BlockPool(4, enable_caching=True)
    pool.allocate(3)
    with pytest.raises(RuntimeError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    assert free_ids(pool) == [3]


def test_free_appends_in_given_order_and_lru_eviction():
    """Blocks freed earlier are reused first; within one free() call, in the order given."""
    pool = BlockPool(6, enable_caching=True)
    a = pool.allocate(2)   # 0, 1
    b = pool.allocate(2)   # 2, 3
    pool.free(b[::-1])     # 3, 2 join the tail
    pool.free(a[::-1])     # then 1, 0
    assert free_ids(pool) == [4, 5, 3, 2, 1, 0]
    assert [blk.block_id for blk in pool.allocate(4)] == [4, 5, 3, 2]


def test_shared_block_is_freed_only_at_zero_references():
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.cache_block(block, 1234)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1
    assert block.block_id not in free_ids(pool)
    pool.free([block])
    assert block.ref_cnt == 0
    assert free_ids(pool)[-1] == block.block_id


def test_free_cached_block_keeps_its_hash_and_a_hit_pulls_it_out_of_the_queue():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(3)
    for i, blk in enumerate(blocks):
        pool.cache_block(blk, 100 + i)
    pool.free(blocks[::-1])
    assert pool.num_free_blocks == 4
    hit = pool.get_cached(101)
    assert hit is blocks[1] and hit.ref_cnt == 0 and hit.block_hash == 101
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.num_free_blocks == 3
    assert free_ids(pool) == [3, 2, 0]
    assert pool.get_cached(101) is hit  # still cached while in use


def test_touch_on_a_block_in_use_only_adds_a_reference():
    pool = BlockPool(3, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.touch([block])
    pool.touch([block])
    assert block.ref_cnt == 3
    assert pool.num_free_blocks == 2


def test_reallocating_a_cached_free_block_evicts_its_hash():
    pool = BlockPool(2, enable_caching=True)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], 7)
    pool.cache_block(blocks[1], 8)
    pool.free(blocks)  # 0 then 1
    (first,) = pool.allocate(1)
    assert first is blocks[0]
    assert first.block_hash is None
    assert pool.get_cached(7) is None
    assert pool.get_cached(8) is blocks[1]
    assert set(pool.cached) == {8}


def test_duplicate_content_stays_private():
    """A second block with a hash that is already cached is not registered (the first
    one keeps serving hits) and is not evicted from the map when reused."""
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache_block(a, 42)
    pool.cache_block(b, 42)
    assert b.block_hash is None
    assert pool.get_cached(42) is a
    pool.free([b])
    (again,) = pool.allocate(1)  # block 2 first, never used
    assert again.block_id == 2
    (reused,) = pool.allocate(1)
    assert reused is b
    assert pool.get_cached(42) is a


def test_cache_block_does_not_rehash_a_cached_block():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.cache_block(block, 5)
    pool.cache_block(block, 6)
    assert block.block_hash == 5
    assert pool.get_cached(6) is None
