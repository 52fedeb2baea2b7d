"""A host-memory mirror of a device KV cache (each TP rank mirrors its shard), for devices
whose memory NIXL should not (or cannot) read directly: the prefill stages finished blocks
out, the decode stages pulled blocks in before the request is scheduled."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.config import ConfigError, KVTransferConfig
from pdserve.platforms.base import Platform


@dataclass(slots=True)
class HostBuffer:
    platform: Platform
    cache: torch.Tensor
    host: torch.Tensor

    @staticmethod
    def needed(config: KVTransferConfig, platform: Platform) -> bool:
        """Whether NIXL reads a host mirror rather than the cache itself (refuses a buffer
        device the platform cannot stage through)."""
        buffer_device = config.kv_buffer_device or platform.name
        try:
            platform.check_buffer_device(buffer_device)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return config.kv_connector_extra_config.use_host_buffer or \
            buffer_device != platform.name

    @classmethod
    def mirror(cls, platform: Platform, cache: torch.Tensor) -> HostBuffer:
        return cls(platform, cache, platform.alloc_host(tuple(cache.shape), cache.dtype))

    def save(self, block_ids: list[int]) -> None:
        self.platform.copy_to_host(self.cache, self.host, block_ids)

    def load(self, block_ids: list[int]) -> None:
        self.platform.copy_to_device(self.host, self.cache, block_ids)
