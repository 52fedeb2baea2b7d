"""Attention read in place from the paged KV cache, on CPU.

Gathering each sequence's K/V into a dense copy for torch's attention moved the whole
context through memory twice per layer; the C++ kernels (csrc/paged_attention.cpp, built by
pdserve.model.native) follow the block table instead: `decode` for single-token queries,
`chunk` for a prefill's queries of one sequence. The chunk kernel also replaced torch's
causal attention, which took ~47 % of a 512-token prefill on one thread here (220 of 464 ms).
With bf16 dot products (AVX512-BF16) a bf16 cache's scores and weighted sums take half the
instructions: a 7,900-token prefill's attention went from 13.4 to 8.2 s on 2 Zen 4 cores.
Where the kernels cannot be built, both keep the gather + torch attention paths."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pdserve.model import native
from pdserve.model.attention import Scores
from pdserve.model.kv_cache import KVCache

HEAD_DIMS = (64, 128)  # the kernels' instantiations
MAX_GROUP = 16  # query heads per KV head (the decode kernel's limit)


@dataclass(frozen=True, slots=True)
class PagedAttention:
    lib: ctypes.CDLL

    @classmethod
    def for_model(cls, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device | str) -> PagedAttention | None:
        """The kernels where they fit this model on this device, else None."""
        fits = (torch.device(device).type == "cpu" and dtype in native.DTYPES
                and head_dim in HEAD_DIMS and num_heads // num_kv_heads <= MAX_GROUP)
        lib = native.library() if fits else None
        return cls(lib) if lib else None

    def decode(self, q: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, cache: KVCache,
               layer: int, tables: torch.Tensor, lens: torch.Tensor, s: Scores) -> None:
        """Attention of single-token queries: query i is row rows[i] of q [T, heads, dim],
        over the first lens[i] cached tokens of block table row i (their last s.window, in a
        window), into the same row of out [T, heads, dim]. q and out may be views of larger
        tensors (each token's heads contiguous): a step's decodes are read and written in
        place. Blocks wholly before a window are not read."""
        _, heads, dim = q.shape
        assert q.stride()[1:] == out.stride()[1:] == (dim, 1), "heads must be contiguous"
        k0, block, kv, token, head = cache.layer_slots(layer)
        self._check(self.lib.pdserve_paged_decode(
            native.DTYPES[cache.tensor.dtype], q.data_ptr(), q.stride(0), out.data_ptr(),
            out.stride(0), rows.data_ptr(), k0, tables.data_ptr(), lens.data_ptr(),
            rows.shape[0], tables.shape[1], heads, cache.shape.num_kv_heads, dim,
            cache.shape.block_size, block, kv, token, head, *_scores(s),
            torch.get_num_threads()), heads, cache, dim)

    def chunk(self, q: torch.Tensor, out: torch.Tensor, cache: KVCache, layer: int,
              table: torch.Tensor, pos: int, s: Scores) -> None:
        """Causal attention of one sequence's query tokens q [n, heads, dim] at positions
        pos, pos + 1, ... (their K/V already cached) into out [n, heads, dim]: token i
        attends to the first pos + i + 1 tokens of block table `table` [1, m] (the last
        s.window of them, in a window; keys before every query's window are not read). q and
        out may be row slices of larger tensors (each token's heads contiguous)."""
        n, heads, dim = q.shape
        assert q.stride()[1:] == out.stride()[1:] == (dim, 1), "heads must be contiguous"
        k0, block, kv, token, head = cache.layer_slots(layer)
        self._check(self.lib.pdserve_paged_chunk(
            native.DTYPES[cache.tensor.dtype], q.data_ptr(), q.stride(0), out.data_ptr(),
            out.stride(0), k0, table.data_ptr(), n, pos, heads, cache.shape.num_kv_heads, dim,
            cache.shape.block_size, block, kv, token, head, *_scores(s),
            torch.get_num_threads()), heads, cache, dim)

    @staticmethod
    def _check(rc: int, heads: int, cache: KVCache, dim: int) -> None:
        if rc:
            raise RuntimeError(f"paged attention kernel has no variant for {heads} heads, "
                               f"{cache.shape.num_kv_heads} KV heads, head_dim {dim}")


def _scores(s: Scores) -> tuple[float, float, int]:
    """The kernels' scale, cap and window arguments (0: none)."""
    return s.scale, s.cap or 0.0, s.window or 0
