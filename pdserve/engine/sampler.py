"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from pdserve.engine.request import Request

_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over the generator's seed space


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self._row_gen = torch.Generator()

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[float]]:
        """Pick one token per row of float32 logits [B, vocab]; return tokens and the
        model's logprob of each (before temperature and truncation)."""
        tokens = logits.argmax(-1)
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rows:
            tokens[rows] = self._sample_rows(logits[rows], [reqs[i] for i in rows])
        logprobs = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
        return tokens.tolist(), logprobs.tolist()

    def _sample_rows(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in reqs]).unsqueeze(1)
        logits = logits / temps
        top_k = [r.params.top_k for r in reqs]
        top_p = [r.params.top_p for r in reqs]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _truncate(logits, top_k, top_p)
        probs = torch.softmax(logits, -1)
        # Gumbel-style: argmax(p / Exp(1)) samples from p, and the noise can come from each
        # request's own seeded generator.
        noise = torch.empty_like(probs)
        for i, r in enumerate(reqs):
            noise[i].exponential_(generator=self._generator(r))
        return (probs / noise).argmax(-1)

    def _generator(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self._gen
        # Seeded by (seed, output position): the same token at the same position whichever
        # instance samples it, so a seeded request is reproducible across prefill/decode.
        return self._row_gen.manual_seed((req.params.seed * _MIX + req.num_output_tokens)
                                         % (1 << 63))


def _truncate(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    sorted_logits, order = logits.sort(-1, descending=True)
    vocab = logits.shape[-1]
    ks = torch.tensor([k if k > 0 else vocab for k in top_k]).unsqueeze(1)
    drop = torch.arange(vocab).unsqueeze(0) >= ks
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), -1)
    ps = torch.tensor(top_p).unsqueeze(1)
    # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
    drop |= (probs.cumsum(-1) - probs) >= ps
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
