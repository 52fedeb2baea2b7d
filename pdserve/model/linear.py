"""Matrix products against weights laid out once, at load, for the device's GEMM kernels."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model import native
from pdserve.platforms.cpu import has_native_bf16

FEW_ROWS = 12  # up to this many rows, products stream the row-major weight (pdserve_gemv)
RAM_SHARE = 8  # row-major copies are kept where the weights take at most 1/8 of the RAM


@dataclass(frozen=True, slots=True)
class Weight:
    """A bf16 weight in both layouts: oneDNN's blocked one for batches, and row-major for
    products of a few rows, which only stream the weight: C++ reads it in order at ~23 GB/s
    where oneDNN's blocked kernels read ~12 here (a decode step of one sequence: the
    products 20.6 -> 9.8 ms on 2 Zen 4 cores). The row-major copy costs the weights' size
    again, less a tied lm_head's, which is the embedding table itself."""
    packed: torch.Tensor
    rows: torch.Tensor


Linear = torch.Tensor | Weight  # what Gemm.weight makes of a weight


@dataclass(frozen=True, slots=True)
class Gemm:
    """`y = x @ w.T + b`. On CPUs with bf16 hardware (AMX, AVX512-BF16), bf16 weights are
    reordered into oneDNN's blocked layout once: plain F.linear reorders them on every call,
    which here made a decode step's products 1.45x slower on one thread and a 512-token
    prefill's 1.85x slower on two (figures in docs/benchmarks.md). Results are unchanged:
    the same kernels run on the same layout. A tied lm_head is packed as its own copy."""
    prepacked: bool
    lib: ctypes.CDLL | None = None  # pdserve_gemv, for the few-row products of a Weight

    @classmethod
    def for_model(cls, dtype: torch.dtype, device: torch.device | str,
                  weight_bytes: int = 0) -> Gemm:
        """weight_bytes: the model's weights, which the row-major copies would double."""
        prepacked = (torch.device(device).type == "cpu" and dtype == torch.bfloat16
                     and has_native_bf16() and torch.backends.mkldnn.is_available())
        spare = weight_bytes * RAM_SHARE <= os.sysconf("SC_PAGE_SIZE") * os.sysconf(
            "SC_PHYS_PAGES")
        return cls(prepacked, native.library() if prepacked and spare else None)

    def weight(self, w: torch.Tensor) -> Linear:
        if not self.prepacked:
            return w
        # The hint (batch 1) picks the decode-friendly blocking; prefills run as fast on it.
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        return Weight(packed, w.contiguous()) if self.lib else packed

    def __call__(self, x: torch.Tensor, w: Linear, b: torch.Tensor | None = None
                 ) -> torch.Tensor:
        if isinstance(w, Weight):
            if x.dim() == 2 and x.shape[0] <= FEW_ROWS:
                y = self._few_rows(x, w.rows, b)
                if y is not None:
                    return y
            w = w.packed
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return F.linear(x, w, b)

    def _few_rows(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
                  ) -> torch.Tensor | None:
        x = x.contiguous()
        y = x.new_empty(x.shape[0], w.shape[0])
        rc = self.lib.pdserve_gemv(x.data_ptr(), w.data_ptr(), None if b is None else
                                   b.data_ptr(), y.data_ptr(), x.shape[0], w.shape[0],
                                   w.shape[1], torch.get_num_threads())
        return None if rc else y
