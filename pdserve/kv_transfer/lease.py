"""Blocks a prefill holds for remote readers, each under a lease that readers renew."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Lease:
    block_ids: list[int]
    readers: int  # notifications still expected before the blocks can go
    deadline: float


@dataclass(slots=True)
class LeaseTable:
    duration: float
    leases: dict[str, Lease] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return sum(len(lease.block_ids) for lease in self.leases.values())

    def hold(self, request_id: str, block_ids: list[int], readers: int = 1) -> None:
        self.leases[request_id] = Lease(block_ids, readers, time.monotonic() + self.duration)

    def renew(self, request_id: str) -> None:
        if (lease := self.leases.get(request_id)) is not None:
            lease.deadline = time.monotonic() + self.duration

    def reader_done(self, request_id: str) -> list[int]:
        """A reader is finished; returns the blocks to free once the last one is."""
        lease = self.leases.get(request_id)
        if lease is None:
            return []
        lease.readers -= 1
        if lease.readers > 0:
            return []
        return self.leases.pop(request_id).block_ids

    def expire(self, now: float | None = None) -> list[tuple[str, list[int]]]:
        now = time.monotonic() if now is None else now
        gone = [rid for rid, lease in self.leases.items() if lease.deadline <= now]
        return [(rid, self.leases.pop(rid).block_ids) for rid in gone]
