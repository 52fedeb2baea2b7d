"""The KV block pool: allocation, reference counts, misuse caught; the prefix cache."""

from __future__ import annotations

import pytest

from pdserve.engine.block_allocator import BlockAllocator, NoFreeBlocks, chain_hashes


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
    pool.cache(ids[0], b"first block")
    assert pool.lookup([b"first block"]) == ids[:1]  # a second request shares it
    pool.free(ids)
    assert pool.num_free == 1  # ids[0] still has its second reference
    pool.free(ids[:1])
    assert pool.num_free == 2


def test_double_free_is_refused():
    pool = BlockAllocator(2)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(ids)
    assert pool.num_free == 2


# -- prefix cache -----------------------------------------------------------------------------

def _hashes(tokens: list[int], block_size: int = 4) -> list[bytes]:
    return chain_hashes(tokens, block_size, [], len(tokens) // block_size)


def test_chain_hash_names_a_block_by_every_token_up_to_its_end():
    a = _hashes([1, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and a == _hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = _hashes([0, 2, 3, 4, 5, 6, 7, 8])  # first block differs: so does the second's hash
    assert a[0] != b[0] and a[1] != b[1]
    known = a[:1]
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, known, 2) is known and known == a


def test_freed_cached_blocks_are_found_again_and_count_as_free():
    pool = BlockAllocator(4)
    ids = pool.allocate(3)
    hashes = _hashes(list(range(12)))
    for block, h in zip(ids, hashes, strict=True):
        pool.cache(block, h)
    pool.free(ids)
    assert pool.num_free == 4
    assert pool.lookup(hashes) == ids and pool.num_free == 1  # references taken
    pool.free(ids)
    assert pool.lookup(hashes[:1] + [b"missing"] + hashes[2:]) == ids[:1]  # prefix only
    pool.free(ids[:1])
    assert pool.num_free == 4


def test_cached_blocks_are_evicted_last_and_least_recently_used_first():
    pool = BlockAllocator(3)
    a, b, c = pool.allocate(3)
    ha, hb = _hashes(list(range(8)))
    pool.cache(a, ha)
    pool.cache(b, hb)
    pool.free([b])
    pool.free([a])  # b is now the least recently used
    pool.free([c])  # nothing cached in c: it is handed out first
    assert pool.allocate(1) == [c]
    assert pool.allocate(1) == [b] and pool.lookup([hb]) == []  # b's content is gone
    assert pool.lookup([ha]) == [a]


def test_a_hash_names_one_block_and_a_disabled_cache_names_none():
    pool = BlockAllocator(2)
    a, b = pool.allocate(2)
    (h,) = _hashes([1, 2, 3, 4])
    pool.cache(a, h)
    pool.cache(b, h)  # the same content computed twice: the first block keeps the name
    pool.free([a, b])
    assert pool.lookup([h]) == [a]
    off = BlockAllocator(2, prefix_caching=False)
    off.cache(off.allocate(1)[0], h)
    assert off.lookup([h]) == []
