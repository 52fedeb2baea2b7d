"""How a layer's attention scores are made (scale, Gemma 2's soft-capping, a sliding window),
and attention with torch over gathered K/V: the path where the paged kernels
(paged_attention.py) do not run (accelerators, head sizes without a kernel)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class Scores:
    """Scores are q.k * scale, then cap * tanh(score / cap) where `cap` is set (Gemma 2), over
    the last `window` keys where it is set (the query's own included: HF's mask keeps keys
    after position - window), else over all earlier keys."""
    scale: float
    cap: float | None = None
    window: int | None = None

    def visible(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[len(positions), len(keys)]: True where the query at each position sees each key."""
        seen = keys.unsqueeze(0) <= positions.unsqueeze(1)
        if self.window:
            seen &= keys.unsqueeze(0) > positions.unsqueeze(1) - self.window
        return seen


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           s: Scores) -> torch.Tensor:
    """Attention of q [..., heads, n, dim] over k, v [..., kv_heads, m, dim] where `mask`
    (broadcast to [..., n, m]) is True; query heads share KV heads in groups."""
    if s.cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s.scale,
                                              enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * s.scale  # as HF's eager attention
    scores = torch.tanh(scores / s.cap) * s.cap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype), v)


def decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lens: torch.Tensor,
           s: Scores) -> torch.Tensor:
    """Single-token queries q [g, heads, dim] over gathered kc, vc [g, kv_heads, m, dim], each
    over its first lens[i] keys; returns [g, heads, dim]."""
    keys = torch.arange(kc.shape[2], device=q.device)
    mask = keys < lens.unsqueeze(1)
    if s.window:
        mask &= keys >= (lens - s.window).unsqueeze(1)
    mask = mask[:, None, None, :]
    # The query heads sharing a KV head are that head's rows: GQA without expanding K/V.
    qd = q.unflatten(1, (kc.shape[1], -1))  # [g, kv_heads, group, dim]
    return attend(qd, kc, vc, mask, s).flatten(1, 2)


def chunk(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: int, s: Scores
          ) -> torch.Tensor:
    """Causal attention of one sequence's queries q [n, heads, dim] at positions pos, ...
    over its keys kc, vc [kv_heads, >= pos + n, dim]; returns [n, heads, dim]."""
    n = q.shape[0]
    kc, vc = kc[:, :pos + n], vc[:, :pos + n]
    keys = torch.arange(pos + n, device=q.device)
    if pos == 0 and s.cap is None and s.window is None:  # torch's causal path, no mask built
        o = F.scaled_dot_product_attention(q.transpose(0, 1), kc, vc, is_causal=True,
                                           scale=s.scale, enable_gqa=True)
    else:
        o = attend(q.transpose(0, 1), kc, vc, s.visible(keys, keys[pos:]), s)
    return o.transpose(0, 1)
