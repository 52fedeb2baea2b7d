"""Decode attention read in place from the paged KV cache, on CPU.

Gathering each sequence's K/V into a dense copy for torch's attention moved the whole
context through memory twice per layer; this C++ kernel (csrc/paged_attention.cpp) follows
the block table instead. It is built with the host's C++ compiler on first use, cached
under the pdserve cache folder, and called through ctypes. Where it cannot be built (no
compiler), decodes keep the gather + torch attention path, with a warning."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from pdserve.model.kv_cache import KVCache
from pdserve.model.loader import cache_dir

log = logging.getLogger("pdserve.model")
SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
HEAD_DIMS = (64, 128)  # the kernel's instantiations
MAX_GROUP = 16  # query heads per KV head
DTYPES = {torch.bfloat16: 1, torch.float32: 0}


@dataclass(frozen=True, slots=True)
class PagedDecode:
    run: ctypes._CFuncPtr

    @classmethod
    def for_model(cls, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device | str) -> PagedDecode | None:
        """The kernel where it fits this model on this device, else None."""
        fits = (torch.device(device).type == "cpu" and dtype in DTYPES
                and head_dim in HEAD_DIMS and num_heads // num_kv_heads <= MAX_GROUP)
        lib = _library() if fits else None
        return cls(lib.pdserve_paged_decode) if lib else None

    def __call__(self, q: torch.Tensor, cache: KVCache, layer: int, tables: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
        """Attention of single-token queries q [seqs, heads, dim] over the first lens[i]
        cached tokens of block table row i; returns [seqs, heads, dim]."""
        q = q.contiguous()
        out = torch.empty_like(q)
        t = cache.tensor
        token, head = cache.token_strides()
        seqs, heads, dim = q.shape
        rc = self.run(DTYPES[t.dtype], q.data_ptr(), out.data_ptr(),
                      t.data_ptr() + layer * t.stride(1) * t.element_size(),
                      tables.data_ptr(), lens.data_ptr(), seqs, tables.shape[1], heads,
                      cache.shape.num_kv_heads, dim, cache.shape.block_size, t.stride(0),
                      t.stride(2), token, head, dim ** -0.5, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"paged decode kernel has no variant for {heads} heads, "
                               f"{cache.shape.num_kv_heads} KV heads, head_dim {dim}")
        return out


@cache
def _library() -> ctypes.CDLL | None:
    path = _build()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pdserve_paged_decode.restype = ctypes.c_int
    lib.pdserve_paged_decode.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, ptr, *[i64] * 10,
                                         ctypes.c_float, ctypes.c_int]
    return lib


def _build() -> Path | None:
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        log.warning("no C++ compiler (g++ or $CXX) on PATH: decode attention gathers K/V "
                    "for torch's attention instead of reading the paged cache in place")
        return None
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-mprefer-vector-width=512")  # GCC's default stops at 256 bits
    # -march=native: the binary is this CPU's, so its features are part of the key.
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), cxx.encode(), " ".join(flags).encode(),
                                     _cpu_features().encode()])).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"paged_attention-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")  # concurrent starts each build, one wins
    done = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(tmp)], capture_output=True,
                          text=True)
    if done.returncode:
        log.warning("building the paged decode kernel failed, decodes use torch's "
                    "attention instead:\n%s", done.stderr[-2000:])
        tmp.unlink(missing_ok=True)
        return None
    os.replace(tmp, out)
    return out


def _cpu_features() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((ln for ln in lines if ln.startswith(("flags", "Features"))), "")
