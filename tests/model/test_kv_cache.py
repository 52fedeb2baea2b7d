"""The paged KV cache's storage: an fp8 cache (--kv-cache-dtype) rounds what it stores, reads
it back as it was stored, and takes a quarter of float32's bytes."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import ConfigError, EngineConfig
from pdserve.model.kv_cache import KVCache, KVShape, cache_dtype


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_an_fp8_cache_stores_rounded_values_and_gathers_them(name, layout):
    dtype = cache_dtype(name, torch.float32)
    assert dtype.itemsize == 1 and cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    shape = KVShape(2, 3, 64, 16, layout)
    cache = KVCache(shape, 4, dtype)
    assert cache.block_bytes * 4 == shape.block_bytes(torch.float32)
    k, v = torch.randn(20, 3, 64) * 100, torch.randn(20, 3, 64)
    slots = torch.tensor([2] * 16 + [0] * 4), torch.tensor([*range(16), *range(4)])
    cache.write(1, k, v, *slots)
    kc, vc = cache.gather(1, torch.tensor([[2, 0]]))
    assert kc.dtype == dtype
    want = torch.cat([k, torch.zeros(12, 3, 64)]).to(dtype).float().transpose(0, 1)
    assert torch.equal(kc[0].float(), want)
    assert torch.equal(vc[0, :, :20].float(), v.to(dtype).float().transpose(0, 1))
    # e4m3 saturates at 448 rather than overflowing to NaN
    assert not kc.float().isnan().any()


def test_a_kv_cache_dtype_is_checked_by_name():
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of auto, fp8"):
        EngineConfig(kv_cache_dtype="int3").validate()
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8 runs on CPU"):
        EngineConfig(kv_cache_dtype="fp8", device="cuda").validate()
