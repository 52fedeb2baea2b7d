"""Intel XPU: KV staged through a CPU host buffer (seed 000), or registered directly."""

from __future__ import annotations

import torch

from pdserve.platforms.base import Platform


class XpuPlatform(Platform):
    def available(self) -> bool:
        return hasattr(torch, "xpu") and torch.xpu.is_available()

    def dist_backend(self) -> str:
        # torch >= 2.8 ships xccl; older stacks get ccl from oneccl_bindings_for_pytorch.
        import torch.distributed as dist

        return "xccl" if getattr(dist, "is_xccl_available", lambda: False)() else "ccl"

    def rank_device(self, index: int) -> torch.device:
        return torch.device("xpu", index % torch.xpu.device_count())

    def synchronize(self) -> None:
        torch.xpu.synchronize()


XPU = XpuPlatform("xpu", ("cpu", "xpu"), "VRAM")
