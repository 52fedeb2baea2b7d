"""Decode attention read in place from the paged KV cache, on CPU.

Gathering each sequence's K/V into a dense copy for torch's attention moved the whole
context through memory twice per layer; this C++ kernel (csrc/paged_attention.cpp, built by
pdserve.model.native) follows the block table instead. Where it cannot be built, decodes
keep the gather + torch attention path."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pdserve.model import native
from pdserve.model.kv_cache import KVCache

HEAD_DIMS = (64, 128)  # the kernel's instantiations
MAX_GROUP = 16  # query heads per KV head


@dataclass(frozen=True, slots=True)
class PagedDecode:
    run: ctypes._CFuncPtr

    @classmethod
    def for_model(cls, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device | str) -> PagedDecode | None:
        """The kernel where it fits this model on this device, else None."""
        fits = (torch.device(device).type == "cpu" and dtype in native.DTYPES
                and head_dim in HEAD_DIMS and num_heads // num_kv_heads <= MAX_GROUP)
        lib = native.library() if fits else None
        return cls(lib.pdserve_paged_decode) if lib else None

    def __call__(self, q: torch.Tensor, cache: KVCache, layer: int, tables: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
        """Attention of single-token queries q [seqs, heads, dim] over the first lens[i]
        cached tokens of block table row i; returns [seqs, heads, dim]."""
        q = q.contiguous()
        out = torch.empty_like(q)
        k0, block, kv, token, head = cache.layer_slots(layer)
        seqs, heads, dim = q.shape
        rc = self.run(native.DTYPES[cache.tensor.dtype], q.data_ptr(), out.data_ptr(), k0,
                      tables.data_ptr(), lens.data_ptr(), seqs, tables.shape[1], heads,
                      cache.shape.num_kv_heads, dim, cache.shape.block_size, block, kv, token,
                      head, dim ** -0.5, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"paged decode kernel has no variant for {heads} heads, "
                               f"{cache.shape.num_kv_heads} KV heads, head_dim {dim}")
        return out
