"""Fixed pool of KV blocks with reference counts, so blocks can be shared and held, and a
prefix cache: a full block's content is named by the hash of its token chain, and a freed
block keeps its content (still findable) until the pool needs it, least recently used first."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque


class NoFreeBlocks(RuntimeError):
    pass


def chain_hashes(tokens: list[int], block_size: int, known: list[bytes],
                 num_blocks: int) -> list[bytes]:
    """Extend `known` (hashes of the first blocks of `tokens`) to `num_blocks` full blocks.
    A block's hash covers all tokens up to its end, so equal hashes mean equal KV."""
    for i in range(len(known), num_blocks):
        h = hashlib.blake2b(known[-1] if known else b"", digest_size=16)
        h.update(array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes())
        known.append(h.digest())
    return known


class BlockAllocator:
    def __init__(self, num_blocks: int, prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # hold nothing worth keeping
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # unused, content kept; LRU first
        self._refs = [0] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached_free)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks(f"need {n} KV blocks, {self.num_free} free")
        ids = [self._take() for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if self._refs[i] == 0:
                raise ValueError(f"block {i} freed twice")
            self._refs[i] -= 1
            if self._refs[i] == 0:
                if i in self._hash_of:
                    self._cached_free[i] = None
                else:
                    self._free.append(i)

    # -- prefix cache --------------------------------------------------------------------

    def cache(self, block: int, block_hash: bytes) -> None:
        """Name a full, computed block by its hash (the first block with a hash keeps it)."""
        if self.prefix_caching and block_hash not in self._by_hash \
                and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Take a reference on the cached blocks of the longest cached prefix of `hashes`."""
        ids: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            ids.append(block)
        for i in ids:
            if self._refs[i] == 0:
                del self._cached_free[i]
            self._refs[i] += 1
        return ids

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._cached_free.popitem(last=False)  # evict the least recently used
        del self._by_hash[self._hash_of.pop(block)]
        return block
