"""Batched sampling: grammar masks, penalties, greedy, temperature, top-k, top-p,
per-request seeds, logprobs and top logprobs."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pdserve.engine.request import Request, TopLogprobs
from pdserve.engine.structured import fill_bitmask
from pdserve.model import native

_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over the generator's seed space
NUCLEUS_WIDTH = 64  # top-p looks for its tokens among this many likeliest first


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self._row_gen = torch.Generator()

    @torch.inference_mode()  # the logits are the model's inference tensors: penalties write them
    def sample(self, logits: torch.Tensor, reqs: list[Request]
               ) -> tuple[list[int], list[float], list[TopLogprobs]]:
        """Pick one token per row of float32 logits [B, vocab]. Returns the tokens, the
        model's logprob of each and each row's top_logprobs most likely tokens: logprobs
        are of the raw distribution, before penalties, temperature and truncation (vLLM's
        default), so they describe the model, not the request's sampling. Logits on an
        accelerator stay there for plain greedy batches: only the tokens come back."""
        if picked := _greedy_picks(logits, reqs):
            return picked
        logits = logits.cpu()  # per-request seeded generators are CPU generators
        raw = torch.log_softmax(logits, -1)
        # Grammar masks come first: penalties, temperature and truncation then act on the
        # allowed tokens only, and greedy picks the likeliest allowed one. The logprobs above
        # stay the raw model's, as for any other request.
        if constrained := [i for i, r in enumerate(reqs) if r.matcher is not None]:
            apply_grammars(logits, constrained, [reqs[i].matcher for i in constrained])
        logits = apply_penalties(logits, reqs)
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if len(rows) == len(reqs):  # no row copies: every request samples
            tokens = self._sample_rows(logits, reqs)
        else:
            tokens = _argmax(logits)
            if rows:
                tokens[rows] = self._sample_rows(logits[rows], [reqs[i] for i in rows])
        logprobs = raw.gather(1, tokens[:, None]).squeeze(1)
        return tokens.tolist(), logprobs.tolist(), _top_logprobs(raw, reqs)

    def _sample_rows(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Draws a token per row of `logits`, which it overwrites."""
        logits = logits.div_(torch.tensor([r.params.temperature for r in reqs]).unsqueeze(1))
        top_k = [r.params.top_k for r in reqs]
        top_p = [r.params.top_p for r in reqs]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _truncate(logits, top_k, top_p)
        # Inverse CDF: one uniform draw per row from the request's own generator, then the
        # first token whose cumulative probability passes it. The Gumbel trick (argmax of
        # p / Exp(1) noise) needs a draw per vocabulary entry: 60 ms of a 64-row step here.
        cdf = torch.softmax(logits, -1).cumsum(-1, dtype=torch.float64)
        u = torch.cat([torch.rand(1, generator=self._generator(r), dtype=torch.float64)
                       for r in reqs])
        total = cdf[:, -1:].contiguous()
        tokens = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True)
        # u * total can round up to the total: then the last token with any probability.
        return torch.minimum(tokens, torch.searchsorted(cdf, total)).squeeze(1)

    def _generator(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self._gen
        # Seeded by (seed, output position): the same token at the same position whichever
        # instance samples it, so a seeded request is reproducible across prefill/decode.
        return self._row_gen.manual_seed((req.params.seed * _MIX + req.num_output_tokens)
                                         % (1 << 63))


def _greedy_picks(logits: torch.Tensor, reqs: list[Request]
                  ) -> tuple[list[int], list[float], list[TopLogprobs]] | None:
    """sample()'s answer when every row is plain greedy (no grammar, penalty or logprobs
    asked for): on CPU from the C++ kernel (two passes over each row in cache, where torch's
    log_softmax and max take three over memory), elsewhere on the logits' device. None where
    it does not apply, or where a row holds NaN or inf or nothing above -inf: the general
    path decides those."""
    plain = all(r.params.greedy and not r.params.penalised and r.matcher is None
                and not r.params.logprobs for r in reqs)
    if not plain or logits.dtype != torch.float32:
        return None
    lib = native.library() if logits.is_cpu else None
    tokens, logprobs = _kernel_greedy(lib, logits) if lib else _torch_greedy(logits)
    if bool(logprobs.isnan().any()):  # NaN also marks a row with no maximum
        return None
    return tokens.tolist(), logprobs.tolist(), [[] for _ in reqs]


def _kernel_greedy(lib, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.contiguous()
    rows, vocab = logits.shape
    tokens, logprobs = torch.empty(rows, dtype=torch.long), torch.empty(rows)
    lib.pdserve_greedy(logits.data_ptr(), rows, vocab, tokens.data_ptr(), logprobs.data_ptr(),
                       torch.get_num_threads())
    return tokens, logprobs


def _torch_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first maximum of each row and its log-probability, computed where the logits are;
    one copy of [2, rows] to the host."""
    top, tokens = logits.max(-1)
    logprobs = top - logits.logsumexp(-1)
    logprobs = logprobs.masked_fill(~top.isfinite(), float("nan"))
    both = torch.stack([tokens.double(), logprobs.double()]).cpu()
    return both[0].long(), both[1].float()


def apply_grammars(logits: torch.Tensor, rows: list[int], matchers: list) -> None:
    """Set to -inf, in place, every token of logits[rows[i]] that matchers[i] forbids now.
    The bitmask's bytes index a table of 8 additive biases each (0 or -inf): one lookup and
    one add over the rows, 1.1 ms for 32 x 49152 here where xgrammar's CPU kernel, a loop
    over bits, takes 6.5-10 ms."""
    vocab = logits.shape[-1]
    bitmask = fill_bitmask(matchers, vocab)
    # int32 words as bytes: byte k of word w holds tokens 32w + 8k ... (little-endian hosts)
    bias = F.embedding(bitmask.view(torch.uint8).long(), _byte_bias()).view(len(rows), -1)
    if len(rows) == len(logits):
        logits.add_(bias[:, :vocab])
    else:
        logits[rows] += bias[:, :vocab]


@functools.cache
def _byte_bias() -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where bit i is set, -inf where it is not."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf"))


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (the first of equal maxima, as argmax): torch's CPU max-with-indices
    kernel is ~3x faster than its argmax (160 vs 500 us for 8 x 49152 float32, one thread)."""
    return x.max(-1).indices


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Repetition penalty (HF: over prompt and output, a seen token's logit divided by it
    when positive, multiplied when negative), then presence and frequency penalties
    (OpenAI: minus pres if the token occurs in the output, minus freq per occurrence).
    Gathers and scatters at the seen tokens only: the cost follows the tokens, not the
    batch x vocabulary. Writes the penalised rows of `logits` in place."""
    rows = [i for i, r in enumerate(reqs) if r.params.penalised]
    if not rows:
        return logits
    sub = [reqs[i] for i in rows]
    x = logits[rows]  # a copy
    rep, pres, freq = (torch.tensor([getattr(r.params, k) for r in sub])
                       for k in ("repetition_penalty", "presence_penalty", "frequency_penalty"))
    outputs = [torch.tensor(r.output_token_ids, dtype=torch.long) for r in sub]
    # Repeated indices write the same value, computed from the logit before the penalty.
    seen = _flat([torch.cat((_prompt_ids(r), o)) for r, o in zip(sub, outputs, strict=True)])
    v = x[seen]
    x[seen] = torch.where(v > 0, v / rep[seen[0]], v * rep[seen[0]])
    out = _flat(outputs)
    x[out] = x[out] - pres[out[0]]
    x.index_put_(out, -freq[out[0]], accumulate=True)
    logits[rows] = x
    return logits


def _prompt_ids(req: Request) -> torch.Tensor:
    """The prompt's distinct token ids, built once per request rather than every step."""
    if req.penalty_prompt_ids is None:
        req.penalty_prompt_ids = torch.tensor(req.prompt_token_ids, dtype=torch.long).unique()
    return req.penalty_prompt_ids


def _flat(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) index tensors of every token of every sequence."""
    lens = torch.tensor([len(s) for s in seqs])
    return torch.repeat_interleave(torch.arange(len(seqs)), lens), torch.cat(seqs)


def _top_logprobs(raw: torch.Tensor, reqs: list[Request]) -> list[TopLogprobs]:
    ks = [r.params.top_logprobs if r.params.logprobs else 0 for r in reqs]
    if not any(ks):
        return [[] for _ in reqs]
    values, ids = raw.topk(max(ks), -1)
    values, ids = values.tolist(), ids.tolist()
    return [list(zip(ids[i][:k], values[i][:k], strict=True)) for i, k in enumerate(ks)]


def _truncate(logits: torch.Tensor, top_k: list[int], top_p: list[float],
              width: int = NUCLEUS_WIDTH) -> torch.Tensor:
    """Each row's top_k likeliest tokens, then the smallest prefix of them whose mass (over
    what top_k kept) reaches top_p; the others' logits become -inf. The kept tokens are the
    likeliest few, so they are found with topk, not a sort of the vocabulary (114 ms for 64
    rows of 49152 here): the largest top_k asked for, and for top_p alone the `width`
    likeliest, with a sort of the whole row only where the nucleus is wider than that."""
    vocab = logits.shape[-1]
    kept = [k if 0 < k < vocab else vocab for k in top_k]
    n = max(kept)
    if n == vocab and any(p < 1 for p in top_p):
        n = min(vocab, max([width, *(k for k in kept if k < vocab)]))
    ks, ps = torch.tensor(kept).unsqueeze(1), torch.tensor(top_p).unsqueeze(1)
    limited = ks < vocab
    values, order = logits.topk(n, -1)
    drop = torch.arange(n).unsqueeze(0) >= ks
    values = values.masked_fill(drop, float("-inf"))
    # Mass over top_k's tokens: those of a row without top_k are its whole vocabulary.
    norm = torch.where(limited, values.logsumexp(-1, keepdim=True),
                       logits.logsumexp(-1, keepdim=True))
    probs = (values - norm).exp()
    nucleus = ps < 1  # top_p 1 keeps all: no rounding of the sum may cut the tail
    drop |= nucleus & ((probs.cumsum(-1) - probs) >= ps)
    # The likeliest token always stays: a top_p below float32's range (1e-300) is 0 here,
    # and the nucleus would keep nothing (a NaN distribution: a token past the vocabulary).
    drop[:, 0] = False
    out = torch.full_like(logits, float("-inf")).scatter_(1, order,
                                                          values.masked_fill(drop, float("-inf")))
    whole = (~limited & ~nucleus).squeeze(1)  # rows truncated by neither: all of the row
    out[whole] = logits[whole]
    # A row without top_k whose first n tokens fall short of top_p: its nucleus is wider.
    wider = ~limited & nucleus & (probs.sum(-1, keepdim=True) < ps)
    if n < vocab and (wider := wider.squeeze(1).nonzero().squeeze(1).tolist()):
        out[wider] = _truncate(logits[wider], [top_k[i] for i in wider],
                               [top_p[i] for i in wider], vocab)
    return out
