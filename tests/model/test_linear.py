"""Gemm: prepacked bf16 weights give the very numbers F.linear gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model.linear import Gemm
from pdserve.platforms.cpu import has_native_bf16


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
