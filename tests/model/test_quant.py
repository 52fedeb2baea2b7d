"""int8 (Q8_0) weights: the kernel against its torch statement, the quantized product against
dequantize-then-multiply, rows independent of their batch, and the embedding's rows."""

from __future__ import annotations

import pytest
import torch

from pdserve.model import native, quant

SHAPES = [(1, 8, 32), (2, 13, 64), (3, 40, 96), (5, 33, 128), (17, 100, 320)]  # m, n, k


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.skipif(native.library() is None, reason="pdserve's CPU kernels are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_the_kernel_computes_its_statement_bit_for_bit(dtype, m, n, k):
    w = quant.quantize(_weight(n, k))
    x = torch.randn(m, k).to(dtype)
    for b in (None, torch.randn(n).to(dtype)):
        got = quant.linear(x, w, b)
        assert got.dtype == dtype and got.shape == (m, n)
        assert torch.equal(got, quant.reference(x, w, b))


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_the_product_is_dequantize_then_multiply(m, n, k):
    """Both sides dequantized and multiplied in float64: the integer path differs only by
    its float32 epilogue (each group's scaled sum rounded once, then summed)."""
    w = quant.quantize(_weight(n, k))
    x = torch.randn(m, k)
    qx, sx = quant.quantize_groups(x)
    qw, sw = quant.unpacked(w)

    def deq(q, s):
        return (q.double().unflatten(-1, (-1, quant.GROUP)) * s.double().unsqueeze(-1)).flatten(-2)

    want = deq(qx, sx) @ deq(qw, sw).T
    got = quant.linear(x, w).double()
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    # and against the unquantized product: 8 bits a side in groups of 32 put ~0.6 % of
    # error on each Gaussian factor, ~0.8 % on the product
    exact = x.double() @ _weight(n, k).double().T
    assert (got - exact).norm() <= 0.02 * exact.norm()


def test_quantize_keeps_each_weight_within_half_a_step_of_its_group():
    w = _weight(64, 96) * torch.linspace(0.01, 10, 96)  # groups of very different ranges
    q, s = quant.unpacked(quant.quantize(w))
    err = (w - (q.float().unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2)).abs()
    step = w.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True) / 127
    # half a step, plus the float16 scale's rounding times the largest quant
    slack = step * (0.5 + 127 * 2**-11)
    assert (err.unflatten(-1, (-1, 32)) <= slack).all()
    assert q.abs().max() <= 127


def test_a_rows_result_does_not_depend_on_its_batch():
    w = quant.quantize(_weight(72, 128))
    x = torch.randn(9, 128) * torch.logspace(-2, 2, 9).unsqueeze(1)
    together = quant.linear(x, w)
    for i in range(9):
        assert torch.equal(quant.linear(x[i:i + 1], w), together[i:i + 1])


def test_embedding_rows_are_the_dequantized_weight():
    w = quant.quantize(_weight(21, 64))
    q, s = quant.unpacked(w)
    ids = torch.tensor([0, 20, 7, 7, 13])
    want = (q.float().unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2)[ids]
    assert torch.equal(quant.rows(w, ids, torch.float32), want)
    assert torch.equal(quant.rows(w, ids, torch.bfloat16), want.bfloat16())


def test_rows_not_a_multiple_of_32_are_refused_by_name():
    with pytest.raises(ValueError, match=r"multiple of 32 wide; one is \[8, 48\]"):
        quant.quantize(_weight(8, 48))
