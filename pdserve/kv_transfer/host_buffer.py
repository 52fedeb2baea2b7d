"""A host-memory mirror of a device KV cache, for devices whose memory NIXL should not
(or cannot) read directly: the prefill stages finished blocks out, the decode stages
pulled blocks in before the request is scheduled."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.platforms.base import Platform


@dataclass(slots=True)
class HostBuffer:
    platform: Platform
    cache: torch.Tensor
    host: torch.Tensor

    @classmethod
    def mirror(cls, platform: Platform, cache: torch.Tensor) -> HostBuffer:
        return cls(platform, cache, platform.alloc_host(tuple(cache.shape), cache.dtype))

    def save(self, block_ids: list[int]) -> None:
        self.platform.copy_to_host(self.cache, self.host, block_ids)

    def load(self, block_ids: list[int]) -> None:
        self.platform.copy_to_device(self.host, self.cache, block_ids)
