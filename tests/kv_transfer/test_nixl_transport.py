"""The handshake's compatibility check: caches of different storage dtypes (--dtype or
--kv-cache-dtype) are refused naming both; the refusal over real servers is in
tests/e2e/test_devices.py."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.nixl_transport import check_compatible
from pdserve.kv_transfer.transport import IncompatibleKV

LAYOUT = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "block_size": 16,
          "layout": "HND", "dtype": "float32", "protocol": 1, "tp_size": 1}


def test_an_fp8_cache_and_a_float32_one_are_refused_naming_both():
    with pytest.raises(IncompatibleKV, match=r"dtype: prefill 'float8_e4m3fn', decode "
                                             r"'float32'.*--kv-cache-dtype"):
        check_compatible(LAYOUT, {**LAYOUT, "dtype": "float8_e4m3fn"})
    check_compatible({**LAYOUT, "dtype": "float8_e4m3fn"}, {**LAYOUT, "dtype": "float8_e4m3fn"})
