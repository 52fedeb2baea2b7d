"""Fixed pool of KV blocks with reference counts, so blocks can be shared and held."""

from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} KV blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def share(self, ids: list[int]) -> None:
        """Take another reference on blocks already in use."""
        for i in ids:
            if self._refs[i] == 0:
                raise ValueError(f"block {i} is free; cannot share it")
            self._refs[i] += 1

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if self._refs[i] == 0:
                raise ValueError(f"block {i} freed twice")
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)
