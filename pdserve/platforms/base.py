"""What the engine and the KV transfer need to know about a device kind."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Platform(ABC):
    name: str  # torch device type: cpu | cuda | xpu
    buffer_devices: tuple[str, ...]  # kv_buffer_device values it supports
    nixl_memory: str  # NIXL memory type of KV on this device: DRAM | VRAM

    @abstractmethod
    def available(self) -> bool: ...

    def device(self) -> torch.device:
        return torch.device(self.name)

    def dist_backend(self) -> str:
        """torch.distributed backend for tensor-parallel all-reduces on this device."""
        return "gloo"

    def rank_device(self, index: int) -> torch.device:
        """The device of the `index`-th rank process on this host."""
        return self.device()

    def check_buffer_device(self, buffer_device: str) -> None:
        if buffer_device not in self.buffer_devices:
            raise ValueError(f"kv_buffer_device {buffer_device!r} is not supported on "
                             f"{self.name}; supported: {', '.join(self.buffer_devices)}")

    def alloc_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for staging KV; pinned where the device can DMA from it."""
        return torch.zeros(shape, dtype=dtype, pin_memory=self.pins_host_memory())

    def pins_host_memory(self) -> bool:
        return False

    def copy_to_host(self, cache: torch.Tensor, host: torch.Tensor, block_ids: list[int]
                     ) -> None:
        """host[ids] = cache[ids] in one indexed copy; returns when the data is there."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        blocks = cache.index_select(0, idx.to(cache.device, non_blocking=True))
        host.index_copy_(0, idx, blocks.to("cpu", non_blocking=self.pins_host_memory()))
        self.synchronize()

    def copy_to_device(self, host: torch.Tensor, cache: torch.Tensor, block_ids: list[int]
                       ) -> None:
        """cache[ids] = host[ids] in one indexed copy; returns when the data is there."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        blocks = host.index_select(0, idx)
        if self.pins_host_memory():
            blocks = blocks.pin_memory()
        dev_idx = idx.to(cache.device, non_blocking=True)
        cache.index_copy_(0, dev_idx, blocks.to(cache.device, non_blocking=True))
        self.synchronize()

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until copies queued on the device are done."""
