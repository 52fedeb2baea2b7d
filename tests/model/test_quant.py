"""Quantized weights (Q8_0, Q4_0, Q4_1): the kernel against its torch statement, the quantized
product against dequantize-then-multiply, rows independent of their batch, llama.cpp's
quantizers' rules, and the embedding's rows."""

from __future__ import annotations

import pytest
import torch

from pdserve.model import native, quant

SHAPES = [(1, 8, 32), (2, 13, 64), (3, 40, 96), (5, 33, 128), (17, 100, 320)]  # m, n, k


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


FORMATS = {"q8_0": 8, "q4_0": 4, "q4_1": 4}  # and their bits


def _quantized(fmt: str, w: torch.Tensor) -> quant.QuantWeight:
    """w in fmt: Q4_1 as llama.cpp's quantizer makes it (d = (max - min) / 15, m = min,
    q = the nearest step up from the min), the others by quant.quantize."""
    if fmt != "q4_1":
        return quant.quantize(w, FORMATS[fmt])
    g = w.unflatten(-1, (-1, quant.GROUP))
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15
    q = ((g - lo.unsqueeze(-1)) / d.unsqueeze(-1) + 0.5).floor().clamp(0, 15)
    return quant.packed(q.to(torch.int8).flatten(-2), d.half(), 4, lo.half())


def _dequantized(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    w = q.double().unflatten(-1, (-1, quant.GROUP)) * s.double().unsqueeze(-1)
    return (w if m is None else w + m.double().unsqueeze(-1)).flatten(-2)


@pytest.mark.skipif(native.library() is None, reason="pdserve's CPU kernels are not built")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_the_kernel_computes_its_statement_bit_for_bit(fmt, dtype, m, n, k):
    w = _quantized(fmt, _weight(n, k))
    x = torch.randn(m, k).to(dtype)
    for b in (None, torch.randn(n).to(dtype)):
        got = quant.linear(x, w, b)
        assert got.dtype == dtype and got.shape == (m, n)
        assert torch.equal(got, quant.reference(x, w, b))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_the_product_is_dequantize_then_multiply(fmt, m, n, k):
    """Both sides dequantized and multiplied in float64: the integer path differs only by
    its float32 epilogue (each group's scaled sums rounded, then summed)."""
    w = _quantized(fmt, _weight(n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    qx, sx = quant.quantize_groups(x)
    want = _dequantized(qx, sx, None) @ _dequantized(*quant.unpacked(w)).T
    got = quant.linear(x, w).double()
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()


@pytest.mark.parametrize(("fmt", "error"), [("q8_0", 0.01), ("q4_0", 0.1), ("q4_1", 0.1)])
def test_the_products_error_against_float_weights(fmt, error):
    """8 bits in groups of 32 put ~0.7 % of error on a product of Gaussian factors, 4 bits
    ~9 % (Q4_1 ~8 %): measured over a shape large enough for the figure to hold (a product
    of 32 inputs alone ranges to twice it)."""
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1))
    exact = x.double() @ _weight(256, 1024).double().T
    got = quant.linear(x, _quantized(fmt, _weight(256, 1024))).double()
    assert (got - exact).norm() <= error * exact.norm()


def test_q8_0_keeps_each_weight_within_half_a_step_of_its_group():
    w = _weight(64, 96) * torch.linspace(0.01, 10, 96)  # groups of very different ranges
    q, s, _ = quant.unpacked(quant.quantize(w, 8))
    err = (w - (q.float().unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2)).abs()
    step = w.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True) / 127
    # half a step, plus the float16 scale's rounding times the largest quant
    slack = step * (0.5 + 127 * 2**-11)
    assert (err.unflatten(-1, (-1, 32)) <= slack).all()
    assert q.abs().max() <= 127


def test_q4_0_is_llama_cpps_rule():
    """d = the group's value of largest magnitude / -8 (so it maps to quant -8), every quant
    within -8..7 and its weight within half a step of q * d, but those clamped to 7 (a value
    near minus the peak would be 8): within a step."""
    w = _weight(16, 64) * torch.linspace(0.01, 10, 64)
    q, s, _ = quant.unpacked(quant.quantize(w, 4))
    groups = w.unflatten(-1, (-1, 32))
    peak = groups.gather(-1, groups.abs().argmax(-1, keepdim=True)).squeeze(-1)
    assert torch.equal(s, (peak / -8).half().float())
    assert q.min() >= -8 and q.max() <= 7
    q = q.unflatten(-1, (-1, 32))
    err = (groups - q.float() * s.unsqueeze(-1)).abs()
    steps = torch.where(q == 7, 1.0, 0.5) + 8 * 2**-11  # plus the float16 scale's rounding
    assert (err <= s.abs().unsqueeze(-1) * steps).all()


@pytest.mark.parametrize(("bits", "low", "high", "with_mins"),
                         [(8, -127, 128, False), (4, -8, 8, False), (4, 0, 16, True)])
def test_packing_round_trips(bits, low, high, with_mins):
    q = torch.randint(low, high, (13, 64), dtype=torch.int8)
    scales, mins = torch.rand(13, 2).half(), -torch.rand(13, 2).half() if with_mins else None
    w = quant.packed(q, scales, bits, mins)
    assert w.q.numel() == 16 * 64 * bits // 8  # n padded to a block of 8
    assert w.nbytes == w.q.numel() + 16 * 2 * 2 * (2 if with_mins else 1)
    back, s, m = quant.unpacked(w)
    assert torch.equal(back, q) and torch.equal(s, scales.float())
    assert m is None if mins is None else torch.equal(m, mins.float())


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_result_does_not_depend_on_its_batch(fmt):
    w = _quantized(fmt, _weight(72, 128))
    x = torch.randn(9, 128) * torch.logspace(-2, 2, 9).unsqueeze(1)
    together = quant.linear(x, w)
    for i in range(9):
        assert torch.equal(quant.linear(x[i:i + 1], w), together[i:i + 1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_embedding_rows_are_the_dequantized_weight(fmt):
    w = _quantized(fmt, _weight(21, 64))
    ids = torch.tensor([0, 20, 7, 7, 13])
    want = _dequantized(*quant.unpacked(w)).float()[ids]
    assert torch.equal(quant.rows(w, ids, torch.float32), want)
    assert torch.equal(quant.rows(w, ids, torch.bfloat16), want.bfloat16())


def test_rows_not_a_multiple_of_32_are_refused_by_name():
    with pytest.raises(ValueError, match=r"multiple of 32 wide; one is \[8, 48\]"):
        quant.quantize(_weight(8, 48), 8)
