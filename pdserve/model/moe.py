"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k
experts, whose SwiGLU outputs are summed weighted by the router's probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.model.elementwise import Elementwise
from pdserve.model.linear import Gemm, Linear


@dataclass(slots=True)
class Experts:
    router: Linear  # [num_experts, hidden]
    gate_up: list[Linear]  # per expert [2 * intermediate, hidden], gate first
    down: list[Linear]  # per expert [hidden, intermediate]
    top_k: int
    renormalise: bool  # the top-k probabilities rescaled to sum to 1

    def __call__(self, x: torch.Tensor, linear: Gemm, ops: Elementwise) -> torch.Tensor:
        """This rank's share of the MLP's output for tokens x [T, hidden] (its experts'
        intermediate slices: the caller all-reduces, as for a dense MLP)."""
        probs = torch.softmax(linear(x, self.router).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalise:
            weights /= weights.sum(-1, keepdim=True)
        # Group the (token, expert) pairs by expert: one pair of GEMMs per expert that has
        # tokens, over all of them, instead of work per token.
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.down)).tolist()
        tokens = order // self.top_k
        scale = weights.flatten()[order].to(x.dtype).unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                rows = tokens[start:start + n]
                y = linear(linear.silu_mul(x[rows], self.gate_up[expert], ops.silu_mul),
                           self.down[expert])
                out.index_add_(0, rows, y * scale[start:start + n])
                start += n
        return out
