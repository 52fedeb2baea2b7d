"""Matrix products against weights laid out once, at load, for the device's GEMM kernels."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model import native
from pdserve.platforms.cpu import has_native_bf16

PAIR_ROWS = 128  # up to this many rows, products take the pair-packed weight (pdserve_pair_gemm)
RAM_SHARE = 8  # pair-packed copies are kept where the weights take at most 1/8 of the RAM


@dataclass(frozen=True, slots=True)
class Weight:
    """A bf16 weight in two layouts: oneDNN's blocked one for batches and prefills, and
    pair-packed (csrc/pair_gemm.cpp) for batches of up to PAIR_ROWS rows, where our kernel
    streams the weight while it computes: 121 products of SmolLM2's shapes on 2 Zen 5 cores,
    24 / 64 / 128 rows, 9.8 / 22.1 / 41.2 ms against oneDNN's 13.7 / 27.1 / 45.7 (parity at
    256). The second layout costs the weight's size again."""
    packed: torch.Tensor
    pairs: torch.Tensor


def pair_packed(w: torch.Tensor) -> torch.Tensor:
    """w [n, k] (k even) as [ceil(n / 16), k / 2, 16, 2]: for each 16 outputs and each pair
    of inputs, the outputs' two weights side by side (zero rows pad n)."""
    n, k = w.shape
    return F.pad(w, (0, 0, 0, -n % 16)).view(-1, 16, k // 2, 2).transpose(1, 2).contiguous()


Linear = torch.Tensor | Weight  # what Gemm.weight makes of a weight


@dataclass(frozen=True, slots=True)
class Gemm:
    """`y = x @ w.T + b`. On CPUs with bf16 hardware (AMX, AVX512-BF16), bf16 weights are
    reordered into oneDNN's blocked layout once: plain F.linear reorders them on every call,
    which here made a decode step's products 1.45x slower on one thread and a 512-token
    prefill's 1.85x slower on two (figures in docs/benchmarks.md). Results are unchanged:
    the same kernels run on the same layout. A tied lm_head is packed as its own copy."""
    prepacked: bool
    lib: ctypes.CDLL | None = None  # pdserve_pair_gemm, for the decode batches of a Weight

    @classmethod
    def for_model(cls, dtype: torch.dtype, device: torch.device | str,
                  weight_bytes: int = 0) -> Gemm:
        """weight_bytes: the model's weights, which the pair-packed copies double."""
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
        return Weight(packed, pair_packed(w)) if self.lib and w.shape[1] % 2 == 0 else packed

    def __call__(self, x: torch.Tensor, w: Linear, b: torch.Tensor | None = None
                 ) -> torch.Tensor:
        if isinstance(w, Weight):
            if x.dim() == 2 and x.shape[0] <= PAIR_ROWS:
                y = self._pairs(x, w, b)
                if y is not None:
                    return y
            w = w.packed
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return F.linear(x, w, b)

    def _pairs(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None
               ) -> torch.Tensor | None:
        x = x.contiguous()
        n = w.packed.shape[0]
        y = x.new_empty(x.shape[0], n)
        rc = self.lib.pdserve_pair_gemm(x.data_ptr(), w.pairs.data_ptr(), None if b is None
                                        else b.data_ptr(), y.data_ptr(), x.shape[0], n,
                                        x.shape[1], torch.get_num_threads())
        return None if rc else y
