"""Quantized weights (Q8_0, Q4_0): the kernel against its torch statement, the quantized
product against dequantize-then-multiply, rows independent of their batch, llama.cpp's
quantizers' rules, and the embedding's rows."""

from __future__ import annotations

import pytest
import torch

from pdserve.model import native, quant

SHAPES = [(1, 8, 32), (2, 13, 64), (3, 40, 96), (5, 33, 128), (17, 100, 320)]  # m, n, k


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.skipif(native.library() is None, reason="pdserve's CPU kernels are not built")
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_the_kernel_computes_its_statement_bit_for_bit(bits, dtype, m, n, k):
    w = quant.quantize(_weight(n, k), bits)
    x = torch.randn(m, k).to(dtype)
    for b in (None, torch.randn(n).to(dtype)):
        got = quant.linear(x, w, b)
        assert got.dtype == dtype and got.shape == (m, n)
        assert torch.equal(got, quant.reference(x, w, b))


@pytest.mark.parametrize(("bits", "error"), [(8, 0.02), (4, 0.15)])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_the_product_is_dequantize_then_multiply(bits, error, m, n, k):
    """Both sides dequantized and multiplied in float64: the integer path differs only by
    its float32 epilogue (each group's scaled sum rounded once, then summed)."""
    w = quant.quantize(_weight(n, k), bits)
    x = torch.randn(m, k)
    qx, sx = quant.quantize_groups(x)
    qw, sw = quant.unpacked(w)

    def deq(q, s):
        return (q.double().unflatten(-1, (-1, quant.GROUP)) * s.double().unsqueeze(-1)).flatten(-2)

    want = deq(qx, sx) @ deq(qw, sw).T
    got = quant.linear(x, w).double()
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    # and against the unquantized product: 8 bits in groups of 32 put ~0.6 % of error on a
    # Gaussian factor, 4 bits ~9 %
    exact = x.double() @ _weight(n, k).double().T
    assert (got - exact).norm() <= error * exact.norm()


def test_q8_0_keeps_each_weight_within_half_a_step_of_its_group():
    w = _weight(64, 96) * torch.linspace(0.01, 10, 96)  # groups of very different ranges
    q, s = quant.unpacked(quant.quantize(w, 8))
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
    q, s = quant.unpacked(quant.quantize(w, 4))
    groups = w.unflatten(-1, (-1, 32))
    peak = groups.gather(-1, groups.abs().argmax(-1, keepdim=True)).squeeze(-1)
    assert torch.equal(s, (peak / -8).half().float())
    assert q.min() >= -8 and q.max() <= 7
    q = q.unflatten(-1, (-1, 32))
    err = (groups - q.float() * s.unsqueeze(-1)).abs()
    steps = torch.where(q == 7, 1.0, 0.5) + 8 * 2**-11  # plus the float16 scale's rounding
    assert (err <= s.abs().unsqueeze(-1) * steps).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_packing_round_trips(bits):
    q = torch.randint(-8 if bits == 4 else -127, 8 if bits == 4 else 128, (13, 64),
                      dtype=torch.int8)
    scales = torch.rand(13, 2).half()
    w = quant.packed(q, scales, bits)
    assert w.q.numel() == 16 * 64 * bits // 8  # n padded to a block of 8
    back, s = quant.unpacked(w)
    assert torch.equal(back, q) and torch.equal(s, scales.float())


@pytest.mark.parametrize("bits", [8, 4])
def test_a_rows_result_does_not_depend_on_its_batch(bits):
    w = quant.quantize(_weight(72, 128), bits)
    x = torch.randn(9, 128) * torch.logspace(-2, 2, 9).unsqueeze(1)
    together = quant.linear(x, w)
    for i in range(9):
        assert torch.equal(quant.linear(x[i:i + 1], w), together[i:i + 1])


@pytest.mark.parametrize("bits", [8, 4])
def test_embedding_rows_are_the_dequantized_weight(bits):
    w = quant.quantize(_weight(21, 64), bits)
    q, s = quant.unpacked(w)
    ids = torch.tensor([0, 20, 7, 7, 13])
    want = (q.float().unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2)[ids]
    assert torch.equal(quant.rows(w, ids, torch.float32), want)
    assert torch.equal(quant.rows(w, ids, torch.bfloat16), want.bfloat16())


def test_rows_not_a_multiple_of_32_are_refused_by_name():
    with pytest.raises(ValueError, match=r"multiple of 32 wide; one is \[8, 48\]"):
        quant.quantize(_weight(8, 48), 8)
