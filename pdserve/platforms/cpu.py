"""CPU: KV in DRAM, registered with NIXL as is."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from pdserve.platforms.base import Platform


class CpuPlatform(Platform):
    def available(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None  # CPU copies are synchronous


CPU = CpuPlatform("cpu", ("cpu",), "DRAM")


@cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def has_native_bf16() -> bool:
    """True where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Elsewhere
    oneDNN emulates it: on the AVX2 hosts measured here a bf16 GEMM ran 4-7x slower
    than float32."""
    return "avx512_bf16" in _cpuinfo() or has_amx()


def has_amx() -> bool:
    """True where the CPU has AMX's bf16 tile multiplies, which oneDNN uses for large
    products."""
    return "amx_bf16" in _cpuinfo()


def default_dtype() -> str:
    return "bfloat16" if has_native_bf16() else "float32"
