"""CUDA: KV in VRAM, read by NIXL directly (cuda) or staged through pinned host memory."""

from __future__ import annotations

import torch

from pdserve.platforms.base import Platform


class CudaPlatform(Platform):
    def available(self) -> bool:
        return torch.cuda.is_available()

    def dist_backend(self) -> str:
        return "nccl"

    def rank_device(self, index: int) -> torch.device:
        return torch.device("cuda", index % torch.cuda.device_count())

    def pins_host_memory(self) -> bool:
        return True

    def synchronize(self) -> None:
        torch.cuda.current_stream().synchronize()


CUDA = CudaPlatform("cuda", ("cuda", "cpu"), "VRAM")
