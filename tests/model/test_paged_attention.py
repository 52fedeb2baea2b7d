"""The paged decode kernel against the gather + torch attention path it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model.kv_cache import KVCache, KVShape
from pdserve.model.llama import DecodeGroup
from pdserve.model.paged_attention import PagedDecode

BS = 16
# Lengths under one block, exactly one, one past a block edge, and several blocks.
LENS = [1, 5, 16, 17, 130, 301]


def _case(layout: str, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(KVShape(3, kv_heads, dim, BS, layout), 64, dtype)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=g))
    width = -(-max(LENS) // BS)
    perm = torch.randperm(64, generator=g)  # scattered blocks catch block-table mistakes
    tables = torch.zeros(len(LENS), width, dtype=torch.long)
    used = 0
    for row, n in enumerate(LENS):
        need = -(-n // BS)
        tables[row, :need] = perm[used:used + need] if row % 2 else perm[:need]  # some share
        used += need
    group = DecodeGroup.build(list(range(len(LENS))), tables, LENS, BS)
    q = torch.randn(len(LENS), heads, dim, generator=g).to(dtype)
    return cache, group, q


def _reference(q, cache: KVCache, layer: int, group: DecodeGroup) -> torch.Tensor:
    kc, vc = cache.gather(layer, group.tables)
    qd = q.float().unflatten(1, (kc.shape[1], -1))
    o = F.scaled_dot_product_attention(qd, kc.float(), vc.float(), attn_mask=group.mask)
    return o.flatten(1, 2)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 128), (16, 1, 64)])
def test_matches_attention_float32(layout, heads, kv_heads, dim):
    kernel = PagedDecode.for_model(heads, kv_heads, dim, torch.float32, "cpu")
    assert kernel is not None, "the kernel did not build (is g++ on PATH?)"
    cache, group, q = _case(layout, torch.float32, heads, kv_heads, dim)
    for layer in range(3):
        got = kernel(q, cache, layer, group.tables, group.lens)
        torch.testing.assert_close(got, _reference(q, cache, layer, group), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_bfloat16_within_one_rounding_of_exact(layout):
    """bf16 in, float32 inside, bf16 out: off from float32 attention of the same bf16
    inputs by at most the output's rounding (half a bf16 ulp, plus float32 noise)."""
    kernel = PagedDecode.for_model(9, 3, 64, torch.bfloat16, "cpu")
    cache, group, q = _case(layout, torch.bfloat16, 9, 3, 64)
    got = kernel(q, cache, 1, group.tables, group.lens).float()
    want = _reference(q, cache, 1, group)
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(2 ** -126)
    assert ((got - want).abs() <= 0.5 * ulp + 1e-6).all()


def test_results_do_not_depend_on_threads_or_batch():
    """Each (sequence, KV head) is one thread's work in a fixed order: a sequence's output
    is bit-identical alone or batched, on one thread or two (monolithic = disaggregated)."""
    kernel = PagedDecode.for_model(9, 3, 64, torch.bfloat16, "cpu")
    cache, group, q = _case("NHD", torch.bfloat16, 9, 3, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        both = kernel(q, cache, 0, group.tables, group.lens)
        torch.set_num_threads(1)
        one = kernel(q, cache, 0, group.tables, group.lens)
    finally:
        torch.set_num_threads(threads)
    alone = kernel(q[4:5], cache, 0, group.tables[4:5], group.lens[4:5])
    assert torch.equal(both, one)
    assert torch.equal(alone, one[4:5])


def test_declines_what_it_has_no_variant_for():
    assert PagedDecode.for_model(9, 3, 80, torch.float32, "cpu") is None  # head_dim 80
    assert PagedDecode.for_model(9, 3, 64, torch.float16, "cpu") is None
    assert PagedDecode.for_model(32, 1, 64, torch.float32, "cpu") is None  # group of 32
    assert PagedDecode.for_model(9, 3, 64, torch.float32, "meta") is None

