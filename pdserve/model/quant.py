"""Weights computed quantized (`--quantization int8` or `int4`): each weight quantized once,
at load, in GGUF's Q8_0 or Q4_0 form (groups of 32 inputs, a quant per weight and a float16
scale per group), and multiplied in integers by rows of x quantized to Q8_0 on the fly
(csrc/quant_gemm.cpp), as llama.cpp multiplies them. A decode step on a CPU costs the bytes of
weights it reads: Q8_0 is 34 bytes per 32 weights and Q4_0 18, against 128 in float32 and 64
in bf16. Embeddings are the same kind of table (a row per token), so a tied lm_head and the
embedding share one copy. Groups of 32 keep activations' outliers local: the embedded SmolLM2
lost 0.5 % of perplexity with int8 in groups, 4.2 % with a scale per output channel and row.

Rows are quantized alone, integer sums are exact and the groups are summed in order, so a
row's output does not depend on the batch it came in: chunked prefills and P/D stay token for
token equal to a monolith. Where the kernel is not built (no AVX2, no compiler) `reference`
computes the same numbers in torch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model import native

GROUP = 32  # inputs sharing a scale (Q8_0's and Q4_0's block)
LANES = 8  # outputs in a block of the packed layout (csrc/quant_gemm.cpp)


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """w [n, k] (k a multiple of 32) as quants of `bits` 8 or 4, octet-packed
    ([ceil(n / 8), k / 8, 64 or 32] bytes, csrc/quant_gemm.cpp), and float16 scales per
    output and group of 32 inputs, [ceil(n / 8), k / 32, 8]: w[o, i] ~ q[o, i] *
    scale[o, i // 32], plus min[o, i // 32] where int4 weights have mins (GGUF's Q4_1 and
    Q4_K: q within 0..15; without, Q4_0's q within -8..7)."""
    q: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int
    bits: int
    mins: torch.Tensor | None = None  # float16, laid out as scales

    @property
    def nbytes(self) -> int:
        return self.q.numel() + (self.scales.numel() + (
            0 if self.mins is None else self.mins.numel())) * 2


@dataclass(frozen=True, slots=True)
class Table:
    """Quants as a format defines them, one row per output: q [n, k] int8 and float16 scales
    (and mins) [n, k / 32] (see QuantWeight). What a loader hands the model, which takes a
    tensor-parallel rank's rows or columns of it, joins q/k/v and gate/up, then packs it."""
    q: torch.Tensor
    scales: torch.Tensor
    bits: int
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def narrow(self, dim: int, start: int, length: int) -> Table:
        if dim == 1 and (start % GROUP or length % GROUP):
            raise ValueError(f"a quantized weight's columns are split in groups of {GROUP}; "
                             f"columns {start}..{start + length} of {self.q.shape[1]} are not")
        g = (start // GROUP, length // GROUP) if dim == 1 else (start, length)
        return Table(self.q.narrow(dim, start, length), self.scales.narrow(dim, *g), self.bits,
                     None if self.mins is None else self.mins.narrow(dim, *g))

    def rows(self, index: torch.Tensor) -> Table:
        return Table(self.q[index], self.scales[index], self.bits,
                     None if self.mins is None else self.mins[index])

    @staticmethod
    def cat(tables: list[Table]) -> Table:
        """The tables' rows one after another (all of one format)."""
        mins = None if tables[0].mins is None else torch.cat([t.mins for t in tables])
        return Table(torch.cat([t.q for t in tables]), torch.cat([t.scales for t in tables]),
                     tables[0].bits, mins)

    def packed(self) -> QuantWeight:
        return packed(self.q, self.scales, self.bits, self.mins)

    def dequantized(self) -> torch.Tensor:
        """The weights in float32."""
        w = self.q.float().unflatten(-1, (-1, GROUP)) * self.scales.float().unsqueeze(-1)
        return (w if self.mins is None else w + self.mins.float().unsqueeze(-1)).flatten(-2)


def bits(quantization: str) -> int:
    """The bits of the weights the model quantizes: int4's 4, else 8 (int8's, and Q8_0 for
    the weights a quantized file or checkpoint does not store in a computable form)."""
    return 4 if quantization == "int4" else 8


def quantize(w: torch.Tensor, bits: int) -> QuantWeight:
    """Q8_0 (bits 8) or Q4_0 (bits 4) of w, as llama.cpp's quantizer makes them."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"quantized weights need rows a multiple of {GROUP} wide; one is "
                         f"[{n}, {k}]")
    q, scales = _q8_0(w) if bits == 8 else _q4_0(w)
    return packed(q, scales.half(), bits)


def _q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of 32: d = max |w| / 127, q = w * (1 / d) rounded half away from zero
    (llama.cpp's reference quantizer; activations take quantize_groups, its AVX2 rule)."""
    x = w.float().unflatten(-1, (-1, GROUP))
    d = x.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, torch.ones_like(d) / d, 0)
    y = x * inv
    q = torch.sign(y) * torch.floor(y.abs() + 0.5)
    return q.to(torch.int8).flatten(-2), d.squeeze(-1)


def _q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of 32: d = (the value of largest magnitude) / -8, q = floor(w / d + 8.5)
    up to 15, minus 8: quants within -8..7."""
    x = w.float().unflatten(-1, (-1, GROUP))
    peak = x.gather(-1, x.abs().argmax(-1, keepdim=True))
    d = peak / -8
    inv = torch.where(d != 0, torch.ones_like(d) / d, 0)
    q = (x * inv + 8.5).floor().clamp(max=15) - 8
    return q.to(torch.int8).flatten(-2), d.squeeze(-1)


def packed(q: torch.Tensor, scales: torch.Tensor, bits: int,
           mins: torch.Tensor | None = None) -> QuantWeight:
    """A QuantWeight from quants q [n, k] int8 (for bits 4, within -8..7, or 0..15 with mins)
    and float16 scales (and mins) [n, k / 32]."""
    n, k = q.shape
    octets = F.pad(q, (0, 0, 0, -n % LANES)).view(-1, LANES, k // 8, 2, 4)
    if bits == 4:  # the octet's first quad in the low halves, its second in the high ones
        u = (octets + (0 if mins is not None else 8)).to(torch.uint8)
        octets = (u[..., 0, :] | (u[..., 1, :] << 4)).view(torch.int8).unsqueeze(-2)
    q = octets.permute(0, 2, 3, 1, 4).reshape(-1, k // 8, LANES * bits)
    return QuantWeight(q.contiguous(), _lanes(scales, n), n, k, bits,
                       None if mins is None else _lanes(mins, n))


def _lanes(t: torch.Tensor, n: int) -> torch.Tensor:
    """Per-group values [n, k / 32] as [ceil(n / 8), k / 32, 8]."""
    return F.pad(t, (0, 0, 0, -n % LANES)).view(-1, LANES, t.shape[1]).transpose(1, 2) \
        .contiguous()


def _octets(w: QuantWeight, q: torch.Tensor) -> torch.Tensor:
    """Packed quants [..., k / 8, LANES * bits] as int8 [..., k / 8, 2, LANES, 4]: each
    octet's two quads for each lane, valued as the format defines them."""
    halves = q.view(*q.shape[:-1], 2 if w.bits == 8 else 1, LANES, 4)
    if w.bits == 8:
        return halves
    u, offset = halves.view(torch.uint8), 0 if w.mins is not None else 8
    return torch.cat([(u & 15).view(torch.int8) - offset, (u >> 4).view(torch.int8) - offset],
                     -3)


def unpacked(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q [n, k] int8 and float32 scales and mins (or None) [n, k / 32] back from the packed
    layout."""
    q = _octets(w, w.q).permute(0, 3, 1, 2, 4).reshape(-1, w.k)[:w.n]

    def groups(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(-1, w.k // GROUP)[:w.n].float()
    return q, groups(w.scales), None if w.mins is None else groups(w.mins)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., k] as int8 in groups of 32 (Q8_0) and their float32 scales [..., k / 32]: the
    kernel's steps, amax / 127 and x * (127 / amax) rounded to nearest even."""
    x = x.float().unflatten(-1, (-1, GROUP))
    amax = x.abs().amax(-1)
    # 127 / amax as a division (a scalar over a tensor is its reciprocal times 127 in torch)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0).unsqueeze(-1)
    return torch.round(x * inv).to(torch.int8).flatten(-2), amax / 127


def rows(w: QuantWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of w dequantized (an embedding lookup), rounded to dtype."""
    block, lane, at = ids // LANES, ids % LANES, torch.arange(len(ids))
    q = _octets(w, w.q[block])[at, :, :, lane].reshape(len(ids), -1, GROUP)
    y = q.float() * w.scales[block][at, :, lane].float().unsqueeze(-1)
    if w.mins is not None:
        y = y + w.mins[block][at, :, lane].float().unsqueeze(-1)
    return y.flatten(-2).to(dtype)


def linear(x: torch.Tensor, w: QuantWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] (float32 or bfloat16) times w^T, plus b: [m, n] in x's dtype."""
    lib = native.library()
    if lib is not None and x.dtype in native.DTYPES and x.dim() == 2:
        x = x.contiguous()
        y = x.new_empty(x.shape[0], w.n)
        rc = lib.pdserve_quant_gemm(w.bits, native.DTYPES[x.dtype], x.data_ptr(),
                                    w.q.data_ptr(), w.scales.data_ptr(),
                                    None if w.mins is None else w.mins.data_ptr(),
                                    None if b is None else b.data_ptr(), y.data_ptr(),
                                    x.shape[0], w.n, w.k, torch.get_num_threads())
        if rc == 0:
            return y
    return reference(x, w, b)


def reference(x: torch.Tensor, w: QuantWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's numbers in torch: each group's integer sums (exact in float64), then
    y += sum * (sx * sw) group by group in float32 (with mins, y += (sum * sw + (sum of x's
    quants) * mw) * sx), plus b, rounded to x's dtype."""
    qx, sx = quantize_groups(x.reshape(-1, w.k))
    qw, sw, mw = unpacked(w)
    sums = torch.einsum("mgi,ngi->gmn", qx.double().unflatten(-1, (-1, GROUP)),
                        qw.double().unflatten(-1, (-1, GROUP))).float()
    tx = qx.unflatten(-1, (-1, GROUP)).sum(-1, dtype=torch.int32).float()
    y = torch.zeros(sums.shape[1:])
    for g, part in enumerate(sums):
        if mw is None:
            y = y + part * (sx[:, g:g + 1] * sw[:, g])
        else:
            y = y + (part * sw[:, g] + tx[:, g:g + 1] * mw[:, g]) * sx[:, g:g + 1]
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.n)
