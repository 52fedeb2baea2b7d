"""The CPU element-wise kernels against the torch formulas they replace (HF's)."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.elementwise import Elementwise
from pdserve.model.kv_cache import KVCache, KVShape

TORCH = Elementwise(None)


def _kernels(dtype: torch.dtype) -> Elementwise:
    ops = Elementwise.for_model(dtype, "cpu")
    assert ops.lib is not None, "the kernels did not build (is g++ on PATH?)"
    return ops


@pytest.mark.parametrize("rows", [1, 7, 512])
@pytest.mark.parametrize("dim", [576, 100])  # 100: a width that is not a multiple of 16
def test_rms_norm(rows, dim):
    g = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=g) * 3
    w = torch.rand(dim, generator=g) + 0.5
    # bf16: the same roundings at the same places, so the same bits for these rows (the sum
    # of squares is added in another order: about 1 element in 100,000 can differ by one
    # bf16 step, within the HF tests' near-tie rule).
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(_kernels(torch.bfloat16).rms_norm(xb, wb, 1e-5),
                       TORCH.rms_norm(xb, wb, 1e-5))
    # float32: only the sum of squares is added in another order.
    torch.testing.assert_close(_kernels(torch.float32).rms_norm(x, w, 1e-5),
                               TORCH.rms_norm(x, w, 1e-5), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ops", ["kernels", "torch"])
def test_rms_norm_with_the_residual_sum(dtype, ops):
    """rms_norm(x, w, eps, add): x += add in place, rounded as torch's add rounds, and the
    norm of that sum: what `x = x + add` and a plain rms_norm give, bit for bit."""
    g = torch.Generator().manual_seed(3)
    x, add = (torch.randn(300, 576, generator=g).to(dtype) * 3 for _ in range(2))
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    norm = _kernels(dtype) if ops == "kernels" else TORCH
    want_sum = x + add
    want = norm.rms_norm(want_sum, w, 1e-5)
    got = norm.rms_norm(x, w, 1e-5, add)
    assert torch.equal(x, want_sum)
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [1, 512])
@pytest.mark.parametrize("dim", [1536, 40])
def test_silu_mul(rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    gate_up = torch.randn(rows, 2 * dim, generator=g) * 4
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's saturation and zero
    gb = gate_up.bfloat16()
    assert torch.equal(_kernels(torch.bfloat16).silu_mul(gb), TORCH.silu_mul(gb))
    torch.testing.assert_close(_kernels(torch.float32).silu_mul(gate_up),
                               TORCH.silu_mul(gate_up), rtol=1e-6, atol=1e-6)


def test_accelerators_keep_torch():
    assert Elementwise.for_model(torch.float32, "meta").lib is None
    assert Elementwise.for_model(torch.float16, "cpu").lib is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "tokens", "rot"),
                         [(9, 3, 64, 5, 64), (4, 2, 40, 300, 40),  # 40: a half not 16-wide
                          (4, 2, 64, 7, 48)])  # partial RoPE (Phi-4-mini's 3/4)
def test_rope_store(dtype, layout, heads, kv_heads, dim, tokens, rot):
    """bf16: the same bits as torch's rotation and cache write, in place and in the cache;
    float32: a product may be fused into the sum (one rounding fewer). Dims past `rot`
    pass unrotated."""
    g = torch.Generator().manual_seed(tokens + dim)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3).to(dtype)
    angles = torch.rand(tokens, rot // 2, generator=g) * 100
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)
    slots = torch.randperm(32 * 16, generator=g)[:tokens]  # scattered, one token each
    blocks, offsets = slots // 16, slots % 16
    out = []
    for ops in (_kernels(dtype), TORCH):
        cache = KVCache(KVShape(2, kv_heads, dim, 16, layout), 32, dtype)
        x = qkv.clone()
        q, k, v = ops.rope_store(x, heads, cos, sin, cache, 1, blocks, offsets)
        assert q.shape == (tokens, heads, dim) and k.shape == v.shape == (tokens, kv_heads, dim)
        assert torch.equal(x.view(tokens, -1, dim)[:, :, rot:],
                           qkv.view(tokens, -1, dim)[:, :, rot:])
        out.append((x, cache.tensor))
    for got, want in zip(out[0], out[1], strict=True):  # qkv, then the cache
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert out[0][1][:, 1].abs().sum() > 0 and not out[0][1][:, 0].any()  # layer 1 only
