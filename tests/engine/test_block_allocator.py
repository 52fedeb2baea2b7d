"""The KV block pool: allocation, reference counts, misuse caught."""

from __future__ import annotations

import pytest

from pdserve.engine.block_allocator import BlockAllocator, NoFreeBlocks


def test_allocate_hands_out_distinct_blocks_until_empty():
    pool = BlockAllocator(8)
    a, b = pool.allocate(3), pool.allocate(5)
    assert len(set(a + b)) == 8 and set(a + b) == set(range(8))
    assert pool.num_free == 0 and not pool.can_allocate(1) and pool.can_allocate(0)
    with pytest.raises(NoFreeBlocks, match="need 1 KV blocks, 0 free"):
        pool.allocate(1)


def test_failed_allocation_takes_nothing():
    pool = BlockAllocator(4)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.num_free == 1


def test_free_returns_blocks_for_reuse():
    pool = BlockAllocator(4)
    ids = pool.allocate(4)
    pool.free(ids[:2])
    assert pool.num_free == 2
    assert sorted(pool.allocate(2)) == sorted(ids[:2])


def test_shared_block_is_free_only_after_last_reference():
    pool = BlockAllocator(2)
    ids = pool.allocate(2)
    pool.share(ids[:1])
    pool.free(ids)
    assert pool.num_free == 1  # ids[0] still has its second reference
    pool.free(ids[:1])
    assert pool.num_free == 2


def test_double_free_and_sharing_a_free_block_are_refused():
    pool = BlockAllocator(2)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(ids)
    with pytest.raises(ValueError, match="is free"):
        pool.share(ids)
    assert pool.num_free == 2
