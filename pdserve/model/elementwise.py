"""RMSNorm, the MLP's SiLU-gated product (GeGLU's: torch), and RoPE with the K/V cache
write: pdserve's CPU kernels (csrc/elementwise.cpp) where they are built, torch elsewhere.
On CPU torch's bfloat16 element-wise ops were ~30 % of a 512-token prefill on one thread
(the norm alone eight ops), and a decode step's rotations and cache writes ~1.7 ms of small
ops; the kernels do each in one pass, rounding where HF's formulas round."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model import native
from pdserve.model.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class Elementwise:
    lib: ctypes.CDLL | None

    @classmethod
    def for_model(cls, dtype: torch.dtype, device: torch.device | str) -> Elementwise:
        fits = torch.device(device).type == "cpu" and dtype in native.DTYPES
        return cls(native.library() if fits else None)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 add: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of x [rows, dim]; with `add`, of x + add, the sum kept in x (x must then
        be contiguous and the caller's to change): a residual stream and its next norm."""
        if add is not None:
            assert x.is_contiguous(), "the residual sum is kept in x"
        if self.lib is None:
            return rms_norm(x if add is None else x.add_(add), weight, eps)
        x, add = x.contiguous(), None if add is None else add.contiguous()
        out = torch.empty_like(x)
        self.lib.pdserve_rms_norm(native.DTYPES[x.dtype], x.data_ptr(),
                                  None if add is None else add.data_ptr(),
                                  weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                                  eps, torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [T, 2 * I] (gate first)."""
        if self.lib is None:
            gate, up = gate_up.chunk(2, -1)
            return F.silu(gate) * up
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self.lib.pdserve_silu_mul(native.DTYPES[gate_up.dtype], gate_up.data_ptr(),
                                  out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out

    @staticmethod
    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate) * up (tanh-approximated GELU: Gemma's GeGLU), in torch."""
        gate, up = gate_up.chunk(2, -1)
        return F.gelu(gate, approximate="tanh") * up

    def rope_store(self, qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache, layer: int, blocks: torch.Tensor, offsets: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotates the q and k heads of qkv [T, (heads + 2 * kv_heads) * dim] in place with
        this batch's cos, sin rows [T, rot] (see `rope`; rot < dim: only each head's first
        rot dims, partial RoPE), stores k and v in `cache`'s layer
        at (block, offset) slots, and returns q, k, v as [T, heads or kv_heads, dim] views."""
        kv_heads, dim = cache.shape.num_kv_heads, cache.shape.head_dim
        q, k, v = qkv.view(qkv.shape[0], -1, dim).split([heads, kv_heads, kv_heads], 1)
        rot = cos.shape[-1]
        if self.lib is None or cache.tensor.dtype != qkv.dtype:  # an fp8 cache: torch stores
            qk = qkv.view(qkv.shape[0], -1, dim)[:, :heads + kv_heads, :rot]
            qk.copy_(rope(qk, cos.unsqueeze(1), sin.unsqueeze(1)))
            cache.write(layer, k, v, blocks, offsets)
            return q, k, v
        k0, *strides = cache.layer_slots(layer)
        self.lib.pdserve_rope_store(native.DTYPES[qkv.dtype], qkv.data_ptr(), cos.data_ptr(),
                                    sin.data_ptr(), qkv.shape[0], heads, kv_heads, dim, rot, k0,
                                    blocks.data_ptr(), offsets.data_ptr(), *strides,
                                    torch.get_num_threads())
        return q, k, v


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE; `sin` carries rotate_half's sign in its first half (see
    llama._rope_table), so the rotation is one roll."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalised in float32, rounded to x's dtype, then weighted."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
