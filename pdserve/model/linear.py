"""Matrix products against weights laid out once, at load, for the device's GEMM kernels."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model import native, quant
from pdserve.model.quant import QuantWeight
from pdserve.platforms.cpu import has_amx, has_native_bf16

PAIR_ROWS = 128  # up to this many rows, products take the pair-packed weight (pdserve_pair_gemm)
# Gated products (Gemm.silu_mul) up to this many rows, on CPUs without AMX: there the kernel
# keeps up with oneDNN to 512 rows and saves the activation's pass (30 gate_up products and
# activations at 256 / 512 rows, Zen 5: 31.6 / 62.6 ms against oneDNN then silu_mul's 33.2 /
# 66.0). Where AMX multiplies oneDNN's large products, they stay its.
GATED_ROWS = 512
RAM_SHARE = 8  # pair-packed copies are kept where the weights take at most 1/8 of the RAM


@dataclass(frozen=True, slots=True)
class Weight:
    """A bf16 weight in two layouts: oneDNN's blocked one for batches and prefills, and
    pair-packed (csrc/pair_gemm.cpp) for batches of up to PAIR_ROWS rows, where our kernel
    streams the weight while it computes: 121 products of SmolLM2's shapes on 2 Zen 5 cores,
    24 / 64 / 128 rows, 9.8 / 22.1 / 41.2 ms against oneDNN's 13.7 / 27.1 / 45.7 (parity at
    256). The second layout costs the weight's size again. A `gated` weight is an MLP's gate
    and up, their pair-packed blocks interleaved (see Gemm.silu_mul)."""
    packed: torch.Tensor
    pairs: torch.Tensor
    gated: bool = False


def pair_packed(w: torch.Tensor) -> torch.Tensor:
    """w [n, k] (k even) as [ceil(n / 16), k / 2, 16, 2]: for each 16 outputs and each pair
    of inputs, the outputs' two weights side by side (zero rows pad n)."""
    n, k = w.shape
    return F.pad(w, (0, 0, 0, -n % 16)).view(-1, 16, k // 2, 2).transpose(1, 2).contiguous()


Linear = torch.Tensor | Weight | QuantWeight  # what Gemm.weight makes of a weight


@dataclass(frozen=True, slots=True)
class Gemm:
    """`y = x @ w.T + b`. On CPUs with bf16 hardware (AMX, AVX512-BF16), bf16 weights are
    reordered into oneDNN's blocked layout once: plain F.linear reorders them on every call,
    which here made a decode step's products 1.45x slower on one thread and a 512-token
    prefill's 1.85x slower on two (figures in docs/benchmarks.md). Results are unchanged:
    the same kernels run on the same layout. A tied lm_head is packed as its own copy."""
    prepacked: bool
    lib: ctypes.CDLL | None = None  # pdserve_pair_gemm, for the decode batches of a Weight
    gated_rows: int = PAIR_ROWS  # the most rows a gated product takes the pairs kernel for
    bits: int = 0  # 8 or 4: weights quantized at load, computed quantized (quant.py)

    @classmethod
    def for_model(cls, dtype: torch.dtype, device: torch.device | str,
                  weight_bytes: int = 0, quantization: str | None = None) -> Gemm:
        """weight_bytes: the model's weights, which the pair-packed copies double."""
        if quantization is not None:
            return cls(False, bits=quant.bits(quantization))
        prepacked = (torch.device(device).type == "cpu" and dtype == torch.bfloat16
                     and has_native_bf16() and torch.backends.mkldnn.is_available())
        spare = weight_bytes * RAM_SHARE <= os.sysconf("SC_PAGE_SIZE") * os.sysconf(
            "SC_PHYS_PAGES")
        return cls(prepacked, native.library() if prepacked and spare else None,
                   PAIR_ROWS if has_amx() else GATED_ROWS)

    def weight(self, w: torch.Tensor | quant.Table, gated: bool = False,
               head: bool = False) -> Linear:
        """gated: w is an MLP's gate and up ([2 * I, k], gate first) for silu_mul; head: w
        is the lm_head, quantized to 8 bits where weights are. A Table (weights stored
        quantized) is computed as it is stored."""
        if isinstance(w, quant.Table):
            return w.packed()
        if self.bits:
            return quant.quantize(w, 8 if head else self.bits)
        if not self.prepacked:
            return w
        # The hint (batch 1) picks the decode-friendly blocking; prefills run as fast on it.
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        if not self.lib or w.shape[1] % 2:
            return packed
        gated = gated and w.shape[0] % 32 == 0  # whole blocks of 16 gate and 16 up outputs
        if gated:  # gate's blocks and up's alternate
            w = w.view(2, -1, 16, w.shape[1]).transpose(0, 1).reshape(w.shape)
        return Weight(packed, pair_packed(w), gated)

    def __call__(self, x: torch.Tensor, w: Linear, b: torch.Tensor | None = None
                 ) -> torch.Tensor:
        if isinstance(w, QuantWeight):
            return quant.linear(x, w, b)
        if isinstance(w, Weight):
            if not w.gated and (y := self._pairs(x, w, b)) is not None:
                return y
            w = w.packed
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return F.linear(x, w, b)

    def silu_mul(self, x: torch.Tensor, w: Linear,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """act(x @ w.T) for an MLP's gate_up weight w and act its SiLU-gated product
        (Elementwise.silu_mul). A gated Weight's batches of up to `gated_rows` take both in
        one kernel call, the activation applied as each tile's sums are stored (the same
        numbers as the pairs kernel's product then silu_mul).
        SmolLM2's 30 gate_up products and activations on 2 Zen 5 cores, 1 / 24 / 64 rows:
        2.69 / 3.43 / 8.49 ms against 2.87 / 3.72 / 8.93 in two calls."""
        if isinstance(w, Weight) and w.gated and (y := self._pairs(x, w)) is not None:
            return y
        return act(self(x, w))

    def _pairs(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None = None
               ) -> torch.Tensor | None:
        """The pairs kernel's product (its gated one for a gated w), or None where it does
        not take this x."""
        if x.dim() != 2 or x.shape[0] > (self.gated_rows if w.gated else PAIR_ROWS):
            return None
        x = x.contiguous()
        n = w.packed.shape[0]
        y = x.new_empty(x.shape[0], n // 2 if w.gated else n)
        rc = self.lib.pdserve_pair_gemm(x.data_ptr(), w.pairs.data_ptr(), None if b is None
                                        else b.data_ptr(), y.data_ptr(), x.shape[0], n,
                                        x.shape[1], int(w.gated), torch.get_num_threads())
        return None if rc else y
