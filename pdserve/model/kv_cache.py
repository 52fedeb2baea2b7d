"""The paged KV cache: one tensor, block-major, so that one block is one contiguous region
across all layers (one NIXL descriptor per run of blocks, not one per layer and K/V)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str  # "NHD": (tokens, heads, dim) within a block; "HND": (heads, tokens, dim)

    def block_shape(self) -> tuple[int, ...]:
        inner = ((self.block_size, self.num_kv_heads, self.head_dim) if self.layout == "NHD"
                 else (self.num_kv_heads, self.block_size, self.head_dim))
        return (self.num_layers, 2, *inner)

    def block_bytes(self, dtype: torch.dtype) -> int:
        n = 1
        for d in self.block_shape():
            n *= d
        return n * dtype.itemsize


# --kv-cache-dtype: 8-bit floats, converted when K and V are stored (rounded to nearest,
# saturating at the format's largest value) and read back in the model's dtype for attention.
# e4m3 keeps 3 bits of mantissa within +-448, e5m2 2 bits within +-57344.
KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}


def cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The cache's storage dtype: the model's for "auto"."""
    return KV_DTYPES.get(kv_cache_dtype, dtype)


class KVCache:
    def __init__(self, shape: KVShape, num_blocks: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.tensor = torch.zeros((num_blocks, *shape.block_shape()), dtype=dtype, device=device)

    @property
    def block_bytes(self) -> int:
        return self.shape.block_bytes(self.tensor.dtype)

    def token_strides(self) -> tuple[int, int]:
        """Element strides from one token to the next within a block, and from one KV head
        to the next."""
        t = self.tensor
        return (t.stride(3), t.stride(4)) if self.shape.layout == "NHD" else (t.stride(4),
                                                                              t.stride(3))

    def layer_slots(self, layer: int) -> tuple[int, int, int, int, int]:
        """For the CPU kernels: the address of `layer`'s K in block 0, and the element
        strides from block to block, K to V, token to token and KV head to KV head."""
        t = self.tensor
        token, head = self.token_strides()
        return (t.data_ptr() + layer * t.stride(1) * t.element_size(), t.stride(0), t.stride(2),
                token, head)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              blocks: torch.Tensor, offsets: torch.Tensor) -> None:
        """Store k, v ([tokens, kv_heads, dim]) at (block, offset) slots."""
        kc, vc = self.tensor[:, layer, 0], self.tensor[:, layer, 1]
        k, v = k.to(kc.dtype), v.to(vc.dtype)  # an fp8 cache rounds them
        if self.shape.layout == "NHD":
            kc[blocks, offsets] = k
            vc[blocks, offsets] = v
        else:
            kc[blocks, :, offsets] = k
            vc[blocks, :, offsets] = v

    def gather(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V for block tables [batch, n] as [batch, kv_heads, n * block_size, dim].

        One index_select of whole contiguous rows each (a block's K or V under NHD, one head
        of it under HND, ordered so the result needs no transposing copy): a memcpy per row."""
        s = self.shape
        b, n = tables.shape
        per_kv = s.num_kv_heads if s.layout == "HND" else 1  # rows per block, layer and K|V
        k_rows = (tables * s.num_layers + layer) * 2 * per_kv
        if s.layout == "HND":  # [b, heads, n]: each head's rows in block order
            k_rows = k_rows.unsqueeze(1) + torch.arange(per_kv, device=tables.device)[:, None]
        rows = self.tensor.view(-1, s.block_size * s.num_kv_heads // per_kv * s.head_dim)
        k, v = (rows.index_select(0, r.flatten()) for r in (k_rows, k_rows + per_kv))
        if s.layout == "NHD":
            return tuple(x.view(b, n * s.block_size, s.num_kv_heads, s.head_dim).transpose(1, 2)
                         for x in (k, v))
        return tuple(x.view(b, s.num_kv_heads, n * s.block_size, s.head_dim) for x in (k, v))
