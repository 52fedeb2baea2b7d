"""Every platform in the table implements every primitive (seed 002's AttributeError can
never come back), and on CPU the copies move exactly the named blocks."""

from __future__ import annotations

import pytest
import torch

from pdserve.platforms import PLATFORMS, get_platform

TABLE = {"cpu": (("cpu",), "DRAM"), "cuda": (("cuda", "cpu"), "VRAM"),
         "xpu": (("cpu", "xpu"), "VRAM")}
PRIMITIVES = ("available", "device", "alloc_host", "copy_to_host", "copy_to_device",
              "synchronize", "check_buffer_device")


@pytest.mark.parametrize("name", sorted(TABLE))
def test_table_and_primitives(name):
    p = PLATFORMS[name]
    assert (p.buffer_devices, p.nixl_memory) == TABLE[name]
    assert not type(p).__abstractmethods__  # every abstract primitive is implemented
    for method in PRIMITIVES:
        assert callable(getattr(p, method)), method


@pytest.mark.parametrize("name", sorted(TABLE))
def test_unsupported_buffer_device_names_the_supported_ones(name):
    p = PLATFORMS[name]
    with pytest.raises(ValueError, match=", ".join(TABLE[name][0])):
        p.check_buffer_device("tpu")
    for ok in TABLE[name][0]:
        p.check_buffer_device(ok)


def _blocks() -> torch.Tensor:
    return torch.arange(10 * 2 * 3 * 4, dtype=torch.float32).reshape(10, 2, 3, 4)


def test_cpu_copies_move_exactly_the_named_blocks():
    cpu = get_platform("cpu")
    cache = _blocks()
    host = cpu.alloc_host(tuple(cache.shape), cache.dtype)
    cpu.copy_to_host(cache, host, [1, 5, 6])
    moved = torch.zeros(10, dtype=torch.bool)
    moved[[1, 5, 6]] = True
    assert torch.equal(host[moved], cache[moved]) and not host[~moved].any()
    target = torch.zeros_like(cache)
    cpu.copy_to_device(host, target, [5, 1])
    assert torch.equal(target[[1, 5]], cache[[1, 5]]) and not target[[0, 6, 9]].any()


@pytest.mark.parametrize("name", ["cuda", "xpu"])
def test_accelerator_copies_match_cpu(name):
    p = PLATFORMS[name]
    if not p.available():
        pytest.skip(f"no {name} device on this machine")
    cache = _blocks().to(p.device())
    host = p.alloc_host(tuple(cache.shape), cache.dtype)
    p.copy_to_host(cache, host, [2, 3, 8])
    assert torch.equal(host[[2, 3, 8]], cache.cpu()[[2, 3, 8]])
    back = torch.zeros_like(cache)
    p.copy_to_device(host, back, [8, 2])
    assert torch.equal(back.cpu()[[2, 8]], cache.cpu()[[2, 8]])


def test_get_platform():
    assert get_platform("auto").available()
    assert get_platform("cpu").name == "cpu"
    with pytest.raises(ValueError, match="unknown device"):
        get_platform("tpu")
    for name in ("cuda", "xpu"):
        if not PLATFORMS[name].available():
            with pytest.raises(ValueError, match="no .* device is available"):
                get_platform(name)
