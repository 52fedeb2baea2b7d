"""Intel XPU: KV staged through a CPU host buffer (seed 000), or registered directly."""

from __future__ import annotations

import torch

from pdserve.platforms.base import Platform


class XpuPlatform(Platform):
    def available(self) -> bool:
        return hasattr(torch, "xpu") and torch.xpu.is_available()

    def synchronize(self) -> None:
        torch.xpu.synchronize()


XPU = XpuPlatform("xpu", ("cpu", "xpu"), "VRAM")
