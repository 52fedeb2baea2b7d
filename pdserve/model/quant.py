"""int8 weights computed quantized (`--quantization int8`): each weight quantized once, at
load, in GGUF's Q8_0 form (groups of 32 inputs, an int8 per weight and a float16 scale per
group), and multiplied in integers by rows of x quantized the same way on the fly
(csrc/int8_gemm.cpp), as llama.cpp multiplies Q8_0. A decode step on a CPU costs the bytes of
weights it reads: this reads 34 bytes per 32 weights, against 128 in float32 and 64 in bf16.
Embeddings are the same kind of table (a row per token), so a tied lm_head and the embedding
share one copy. Groups of 32 keep activations' outliers local: the embedded SmolLM2 lost 0.5 %
of perplexity with them, 4.2 % with a scale per output channel and per row of x.

Rows are quantized alone, integer sums are exact and the groups are summed in order, so a
row's output does not depend on the batch it came in: chunked prefills and P/D stay token for
token equal to a monolith. Where the kernel is not built (no AVX2, no compiler) `reference`
computes the same numbers in torch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model import native

GROUP = 32  # inputs sharing a scale (Q8_0's block)
LANES, QUAD = 8, 4  # a block of 8 outputs by a quad of 4 inputs (csrc/int8_gemm.cpp)


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """w [n, k] (k a multiple of 32) as int8 quants quad-packed, [ceil(n / 8), k / 4, 8, 4],
    and float16 scales per output and group of 32 inputs, [ceil(n / 8), k / 32, 8]:
    w[o, i] ~ q[o, i] * scale[o, i // 32]."""
    q: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 2


def quantize(w: torch.Tensor) -> Int8Weight:
    """Q8_0: per output and group of 32 inputs, scale = max |w| / 127 (kept as float16) and
    q = round(w * 127 / max |w|), as llama.cpp's quantizer does."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"--quantization int8 needs weights whose rows are a multiple of "
                         f"{GROUP} wide; one is [{n}, {k}]")
    q, scales = quantize_groups(w)
    return packed(q, scales.half())


def packed(q: torch.Tensor, scales: torch.Tensor) -> Int8Weight:
    """An Int8Weight from quants q [n, k] int8 and float16 scales [n, k / 32]."""
    n, k = q.shape
    q = F.pad(q, (0, 0, 0, -n % LANES)).view(-1, LANES, k // QUAD, QUAD).transpose(1, 2)
    scales = F.pad(scales, (0, 0, 0, -n % LANES)).view(-1, LANES, k // GROUP).transpose(1, 2)
    return Int8Weight(q.contiguous(), scales.contiguous(), n, k)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., k] as int8 in groups of 32 and their float32 scales [..., k / 32]: the
    kernel's steps, amax / 127 and x * (127 / amax) rounded to nearest even."""
    x = x.float().unflatten(-1, (-1, GROUP))
    amax = x.abs().amax(-1)
    # 127 / amax as a division (a scalar over a tensor is its reciprocal times 127 in torch)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0).unsqueeze(-1)
    return torch.round(x * inv).to(torch.int8).flatten(-2), amax / 127


def unpacked(w: Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, k] and float32 scales [n, k / 32] back from the packed layout."""
    q = w.q.transpose(1, 2).reshape(-1, w.k)[:w.n]
    return q, w.scales.transpose(1, 2).reshape(-1, w.k // GROUP)[:w.n].float()


def rows(w: Int8Weight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of w dequantized (an embedding lookup), rounded to dtype."""
    q = w.q[ids // LANES, :, ids % LANES, :].reshape(len(ids), -1, GROUP)
    s = w.scales[ids // LANES, :, ids % LANES].float()
    return (q.float() * s.unsqueeze(-1)).flatten(1).to(dtype)


def linear(x: torch.Tensor, w: Int8Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] (float32 or bfloat16) times w^T, plus b: [m, n] in x's dtype."""
    lib = native.library()
    if lib is not None and x.dtype in native.DTYPES and x.dim() == 2:
        x = x.contiguous()
        y = x.new_empty(x.shape[0], w.n)
        rc = lib.pdserve_int8_gemm(native.DTYPES[x.dtype], x.data_ptr(), w.q.data_ptr(),
                                   w.scales.data_ptr(), None if b is None else b.data_ptr(),
                                   y.data_ptr(), x.shape[0], w.n, w.k, torch.get_num_threads())
        if rc == 0:
            return y
    return reference(x, w, b)


def reference(x: torch.Tensor, w: Int8Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's numbers in torch: each group's integer sums (exact in float64), then
    y += sum * (sx * sw) group by group in float32, plus b, rounded to x's dtype."""
    qx, sx = quantize_groups(x.reshape(-1, w.k))
    qw, sw = unpacked(w)
    sums = torch.einsum("mgi,ngi->gmn", qx.double().unflatten(-1, (-1, GROUP)),
                        qw.double().unflatten(-1, (-1, GROUP))).float()
    y = torch.zeros(sums.shape[1:])
    for g, part in enumerate(sums):
        y = y + part * (sx[:, g:g + 1] * sw[:, g])
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.n)
