"""RMSNorm and the MLP's SiLU-gated product: pdserve's CPU kernels (csrc/elementwise.cpp)
where they are built, torch elsewhere. On CPU torch's bfloat16 element-wise ops were ~30 %
of a 512-token prefill on one thread (the norm alone eight ops); the kernels do each in one
pass, rounding where HF's formulas round."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model import native


@dataclass(frozen=True, slots=True)
class Elementwise:
    lib: ctypes.CDLL | None

    @classmethod
    def for_model(cls, dtype: torch.dtype, device: torch.device | str) -> Elementwise:
        fits = torch.device(device).type == "cpu" and dtype in native.DTYPES
        return cls(native.library() if fits else None)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.lib is None:
            return rms_norm(x, weight, eps)
        x = x.contiguous()
        out = torch.empty_like(x)
        self.lib.pdserve_rms_norm(native.DTYPES[x.dtype], x.data_ptr(), weight.data_ptr(),
                                  out.data_ptr(), x.shape[0], x.shape[1], eps,
                                  torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [T, 2 * I] (gate first)."""
        if self.lib is None:
            gate, up = gate_up.chunk(2, -1)
            return F.silu(gate) * up
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self.lib.pdserve_silu_mul(native.DTYPES[gate_up.dtype], gate_up.data_ptr(),
                                  out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalised in float32, rounded to x's dtype, then weighted."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
