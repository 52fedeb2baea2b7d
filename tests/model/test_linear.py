"""Gemm: prepacked bf16 weights give the very numbers F.linear gives; products of a few rows
stream a row-major copy, where there is memory for it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pdserve.model.elementwise import Elementwise
from pdserve.model.linear import GATED_ROWS, PAIR_ROWS, RAM_SHARE, Gemm, Weight, pair_packed
from pdserve.platforms.cpu import has_amx, has_native_bf16


def test_prepacks_only_bf16_on_cpus_with_bf16_hardware():
    assert Gemm.for_model(torch.bfloat16, "cpu").prepacked == has_native_bf16()
    assert not Gemm.for_model(torch.float32, "cpu").prepacked
    assert not Gemm.for_model(torch.bfloat16, "meta").prepacked


@pytest.mark.skipif(not has_native_bf16(), reason="needs a CPU with bf16 hardware (AMX or "
                    "AVX512-BF16)")
@pytest.mark.parametrize("rows", [1, 7, 512])
def test_prepacked_product_equals_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(960, 576, generator=g).bfloat16()
    b = torch.randn(960, generator=g).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    gemm = Gemm(prepacked=True)
    packed = gemm.weight(w)
    assert torch.equal(gemm(x, packed), F.linear(x, w))
    assert torch.equal(gemm(x, packed, b), F.linear(x, w, b))
    # A row's result does not depend on what else is in the batch.
    assert torch.equal(gemm(x[:1], packed), gemm(x, packed)[:1])


@pytest.mark.skipif(not has_native_bf16(), reason="needs a CPU with bf16 hardware (AMX or "
                    "AVX512-BF16)")
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 100)])  # and tails of both
def test_decode_batches_take_the_pair_packed_weight(n, k):
    """Up to PAIR_ROWS rows take pdserve_pair_gemm on the pair-packed copy: float32 sums
    rounded once to bf16 (within a bf16 rounding of the exact product), each row's result
    the same whatever the rows around it; more rows take oneDNN's packed weight, F.linear's
    very numbers."""
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(PAIR_ROWS + 1, k, generator=g).bfloat16()
    gemm = Gemm.for_model(torch.bfloat16, "cpu")
    weight = gemm.weight(w)
    assert isinstance(weight, Weight)
    assert torch.equal(weight.pairs[1, 3, 5], w[16 + 5, 6:8])  # block 1, pair 3, output 5
    if n % 16:
        assert not weight.pairs[-1, :, n % 16:].any()  # zero rows pad n
    exact = x.double() @ w.double().T + b.double()
    too_big = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // RAM_SHARE + 1
    assert not isinstance(Gemm.for_model(torch.bfloat16, "cpu", too_big).weight(w), Weight)
    alone = gemm(x[-2:-1], weight, b)
    for rows in (*range(1, 14), 24, 25, 47, PAIR_ROWS):  # whole 12-row tiles and tails
        y = gemm(x[:rows], weight, b)
        assert ((y.double() - exact[:rows]).abs() <= exact[:rows].abs() * 2**-8 + 1e-4).all()
        assert torch.equal(y[:1], gemm(x[:1], weight, b))
    assert torch.equal(gemm(x[:PAIR_ROWS], weight, b)[-1:], alone)  # the last row alone
    threads = torch.get_num_threads()
    try:  # however the output blocks are dealt out to threads
        torch.set_num_threads(1)
        one = gemm(x[:PAIR_ROWS], weight, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, gemm(x[:PAIR_ROWS], weight, b))
    assert torch.equal(gemm(x, weight, b), F.linear(x, w, b))


def test_pair_packing_needs_an_even_width():
    gemm = Gemm.for_model(torch.bfloat16, "cpu")
    if gemm.lib is None:
        pytest.skip("no pair-packed kernel here (needs AVX512-BF16)")
    assert not isinstance(gemm.weight(torch.randn(32, 7).bfloat16()), Weight)
    assert pair_packed(torch.arange(64.).view(2, 32)).shape == (1, 16, 16, 2)


@pytest.mark.parametrize("rows", [1, 13, 64, PAIR_ROWS, PAIR_ROWS + 1, GATED_ROWS + 1])
def test_gated_product_equals_product_then_silu_mul(rows):
    """An MLP's gate_up packed `gated` (gate's and up's blocks interleaved) gives the very
    numbers of the pairs kernel's product then silu_mul, in its epilogue, up to gated_rows
    (PAIR_ROWS on AMX hosts), each row's whatever the batch; past that, oneDNN's product
    then silu_mul. The gated weight's plain product is oneDNN's (F.linear's numbers)."""
    gemm = Gemm.for_model(torch.bfloat16, "cpu")
    if gemm.lib is None:
        pytest.skip("no pair-packed kernel here (needs AVX512-BF16)")
    ops = Elementwise.for_model(torch.bfloat16, "cpu")
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(2 * 96, 100, generator=g) * 0.3).bfloat16()  # 6 blocks each of gate, up
    x = torch.randn(rows, 100, generator=g).bfloat16()
    gated = gemm.weight(w, gated=True)
    assert gated.gated
    assert torch.equal(gated.pairs[1, 3, 5], w[96 + 5, 6:8])  # block 1: up's first block
    plain = gemm.weight(w)
    if rows <= gemm.gated_rows:  # the pairs kernel's, PAIR_ROWS rows at a time
        expected = torch.cat([ops.silu_mul(gemm(x[i:i + PAIR_ROWS], plain))
                              for i in range(0, rows, PAIR_ROWS)])
    else:
        expected = ops.silu_mul(gemm(x, plain))
    assert torch.equal(gemm.silu_mul(x, gated, ops.silu_mul), expected)
    assert torch.equal(gemm.silu_mul(x, plain, ops.silu_mul), ops.silu_mul(gemm(x, plain)))
    assert torch.equal(gemm(x, gated), F.linear(x, w))


def test_gated_packing_needs_whole_blocks_of_gate_and_up():
    gemm = Gemm.for_model(torch.bfloat16, "cpu")
    if gemm.lib is None:
        pytest.skip("no pair-packed kernel here (needs AVX512-BF16)")
    assert not gemm.weight(torch.randn(2 * 40, 64).bfloat16(), gated=True).gated


def test_gated_products_take_the_pairs_kernel_to_gated_rows_without_amx():
    gemm = Gemm.for_model(torch.bfloat16, "cpu")
    assert gemm.gated_rows == (PAIR_ROWS if has_amx() else GATED_ROWS)
