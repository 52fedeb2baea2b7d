"""Device kinds: `get_platform("auto" | "cpu" | "cuda" | "xpu")`."""

from __future__ import annotations

from pdserve.platforms.base import Platform
from pdserve.platforms.cpu import CPU
from pdserve.platforms.cuda import CUDA
from pdserve.platforms.xpu import XPU

PLATFORMS: dict[str, Platform] = {p.name: p for p in (CPU, CUDA, XPU)}


def get_platform(name: str) -> Platform:
    if name == "auto":
        return next(p for p in (CUDA, XPU, CPU) if p.available())
    if name not in PLATFORMS:
        raise ValueError(f"unknown device {name!r}; choose auto, {', '.join(PLATFORMS)}")
    platform = PLATFORMS[name]
    if not platform.available():
        raise ValueError(f"--device {name}: no {name} device is available here")
    return platform
