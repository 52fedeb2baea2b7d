"""pdserve's C++ kernels for CPU (csrc/): built into one library with the host's C++
compiler on first use, cached under the pdserve cache folder, called through ctypes (which
releases the GIL for the call). Where they cannot be built (no compiler), `library()` is
None, with a warning, and callers keep their torch paths."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch

from pdserve.model.loader import cache_dir

log = logging.getLogger("pdserve.model")
CSRC = Path(__file__).with_name("csrc")
DTYPES = {torch.bfloat16: 1, torch.float32: 0}  # the kernels' dtypes, as their `bf16` flag
_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # name: (result, arguments), as declared in csrc/*.cpp
    "pdserve_paged_decode": (_INT, [_INT, _PTR, _I64, _PTR, _I64, *[_PTR] * 4,
                                    *[_I64] * 10, _F32, _F32, _I64, _INT]),
    "pdserve_paged_chunk": (_INT, [_INT, _PTR, _I64, _PTR, _I64, _PTR, _PTR, *[_I64] * 10,
                                   _F32, _F32, _I64, _INT]),
    "pdserve_rms_norm": (None, [_INT, *[_PTR] * 4, _I64, _I64, _F32, _INT]),
    "pdserve_silu_mul": (None, [_INT, _PTR, _PTR, _I64, _I64, _INT]),
    "pdserve_pair_gemm": (_INT, [*[_PTR] * 4, *[_I64] * 3, _INT, _INT]),
    "pdserve_greedy": (None, [_PTR, _I64, _I64, _PTR, _PTR, _INT]),
    "pdserve_rope_store": (None, [_INT, *[_PTR] * 3, *[_I64] * 5, *[_PTR] * 3, *[_I64] * 4,
                                  _INT]),
    "pdserve_decode_layers": (_INT, [_PTR, _PTR, _I64, _I64]),
    "pdserve_quant_gemm": (_INT, [_INT, _INT, *[_PTR] * 6, *[_I64] * 3, _INT]),
}


@cache
def library() -> ctypes.CDLL | None:
    try:
        path = _build()
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:  # unwritable cache, a hung compiler
        log.warning("pdserve's CPU kernels are off (%s); torch paths are used instead", e)
        return None
    for name, (result, args) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = result, args
    return lib


def _build() -> Path | None:
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        log.warning("no C++ compiler (g++ or $CXX) on PATH: pdserve's CPU kernels are off; "
                    "decode attention gathers K/V for torch's attention instead")
        return None
    sources, headers = sorted(CSRC.glob("*.cpp")), sorted(CSRC.glob("*.h"))
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", f"-I{CSRC}"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-mprefer-vector-width=512")  # GCC's default stops at 256 bits
    # -march=native: the binary is this CPU's, so its features are part of the key.
    parts = [p.read_bytes() for p in sources + headers]
    key = hashlib.sha256(b"\0".join([*parts, cxx.encode(), " ".join(flags).encode(),
                                     _cpu_features().encode()])).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"pdserve-kernels-{key}.so"
    failed = out.with_suffix(".failed")  # a build that failed once fails again: say so
    if out.exists():
        return out
    if failed.exists():
        log.warning("pdserve's CPU kernels did not build for this CPU and compiler (%s); "
                    "torch paths are used instead", failed)
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")  # concurrent starts each build, one wins
    done = subprocess.run([cxx, *flags, *map(str, sources), "-o", str(tmp)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        errors = "\n".join(ln for ln in done.stderr.splitlines() if "error" in ln)
        log.warning("building pdserve's CPU kernels failed; torch paths are used "
                    "instead:\n%s", (errors or done.stderr)[-2000:])
        tmp.unlink(missing_ok=True)
        failed.write_text(done.stderr)
        return None
    os.replace(tmp, out)
    return out


def _cpu_features() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((ln for ln in lines if ln.startswith(("flags", "Features"))), "")
