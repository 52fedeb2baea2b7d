"""Matrix products against weights laid out once, at load, for the device's GEMM kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.platforms.cpu import has_native_bf16


@dataclass(frozen=True, slots=True)
class Gemm:
    """`y = x @ w.T + b`. On CPUs with bf16 hardware (AMX, AVX512-BF16), bf16 weights are
    reordered into oneDNN's blocked layout once: plain F.linear reorders them on every call,
    which here made a decode step's products 1.45x slower on one thread and a 512-token
    prefill's 1.85x slower on two (figures in docs/benchmarks.md). Results are unchanged:
    the same kernels run on the same layout. A tied lm_head is packed as its own copy."""
    prepacked: bool

    @classmethod
    def for_model(cls, dtype: torch.dtype, device: torch.device | str) -> Gemm:
        return cls(torch.device(device).type == "cpu" and dtype == torch.bfloat16
                   and has_native_bf16() and torch.backends.mkldnn.is_available())

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        # The hint (batch 1) picks the decode-friendly blocking; prefills run as fast on it.
        return torch.ops.mkldnn._reorder_linear_weight(w, 1) if self.prepacked else w

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
                 ) -> torch.Tensor:
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return F.linear(x, w, b)
