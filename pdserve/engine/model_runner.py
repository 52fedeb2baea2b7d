"""Turns a schedule into one flat model batch, runs it, and samples."""

from __future__ import annotations

from pdserve.engine.decode_graphs import DecodeGraphs, Decodes
from pdserve.engine.prompt_logprobs import PromptSpan, score, span
from pdserve.engine.request import Request, TopLogprobs
from pdserve.engine.sampler import Sampler
from pdserve.model.kv_cache import KVCache
from pdserve.model.llama import Batch, Chunk, DecodeGroup, LlamaModel, longs

# Where decodes gather K/V for torch's attention on CPU (no paged decode kernel), they go in
# groups of similar context length, each group's copy at most this many (padded) tokens: the
# copy then stays in cache for the attention reading it, and little padding is gathered.
# 4096 tokens of SmolLM2 K/V are 6 MB in float32.
CPU_DECODE_GROUP_TOKENS = 4096


class ModelRunner:
    """`graphs`: where decode-only steps run padded (CUDA graphs); they keep the cache's last
    block as their scratch block, out of the allocator's `num_blocks`."""

    def __init__(self, model: LlamaModel, cache: KVCache, sampler: Sampler,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.graphs = graphs
        self.block_size = cache.shape.block_size

    @property
    def num_blocks(self) -> int:
        """The KV blocks the engine may allocate."""
        return self.cache.num_blocks - (self.graphs is not None)

    @property
    def group_tokens(self) -> int | None:
        # Accelerators and the paged kernel (it copies nothing) prefer one call over all.
        gathers = self.cache.tensor.is_cpu and self.model.paged is None
        return CPU_DECODE_GROUP_TOKENS if gathers else None

    def run(self, items: list[tuple[Request, int]]
            ) -> tuple[list[Request], list[int], list[float], list[TopLogprobs]]:
        """Compute the scheduled tokens; sample for requests whose known tokens are all
        computed now. Returns (sampled requests, their tokens, logprobs, top logprobs).
        Prefill chunks of requests asking for prompt logprobs append them to the request."""
        if (decodes := self._graphed(items)) is not None:
            sampled, logits = [req for req, _ in items], self.graphs.run(decodes)
        else:
            batch, sampled, spans = self.prepare(items)
            logits = self.model.forward(batch.to(self.cache.tensor.device), self.cache)
            score(logits[len(sampled):], spans)  # on the device: only the scores come back
        if not sampled:
            return [], [], [], []
        return sampled, *self.sampler.sample(logits[:len(sampled)], sampled)

    def _graphed(self, items: list[tuple[Request, int]]) -> Decodes | None:
        """The step's rows for `graphs`, where it has them and every item is a decode."""
        if self.graphs is None:
            return None
        d = Decodes()
        for req, n in items:
            start = req.num_computed_tokens
            if n != 1 or start + 1 != len(req.token_ids) or span(req, start, n, 0) is not None:
                return None
            d.add(req.token_ids[start], start, req.block_ids, self.block_size)
        return d if self.graphs.fits(len(d.ids), d.width) else None

    def prepare(self, items: list[tuple[Request, int]]
                ) -> tuple[Batch, list[Request], list[PromptSpan]]:
        """The flat batch; the requests it samples for (their logits rows first, in this
        order), and the prompt spans it scores (their rows next)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        logits_index: list[int] = []
        sampled: list[Request] = []
        decodes: list[tuple[int, Request]] = []
        chunks: list[Chunk] = []
        spans: list[PromptSpan] = []
        for req, n in items:
            start, flat = req.num_computed_tokens, len(ids)
            pos = range(start, start + n)
            ids += req.token_ids[start:start + n]
            positions += pos
            blocks += [req.block_ids[p // bs] for p in pos]
            if n == 1 and start > 0:
                decodes.append((flat, req))
            else:
                table = longs([req.block_ids[:-(-(start + n) // bs)]])
                chunks.append(Chunk(flat, flat + n, start, table))
            if start + n == len(req.token_ids):
                logits_index.append(flat + n - 1)
                sampled.append(req)
            if (s := span(req, start, n, flat)) is not None:
                spans.append(s)
        # Only requests asking for prompt logprobs add rows: the others cost nothing more.
        for s in spans:
            logits_index += range(s.first_row, s.first_row + len(s.targets))
        pos_t = longs(positions)
        batch = Batch(longs(ids), pos_t, longs(blocks), pos_t % bs, longs(logits_index),
                      chunks=chunks)
        if decodes:
            self._add_decodes(batch, decodes)
        return batch, sampled, spans

    def _add_decodes(self, batch: Batch, decodes: list[tuple[int, Request]]) -> None:
        bs = self.block_size
        group: list[tuple[int, Request]] = []
        for flat, req in sorted(decodes, key=lambda d: d[1].num_computed_tokens):
            width = -(-(req.num_computed_tokens + 1) // bs) * bs  # the group's widest: sorted
            if group and self.group_tokens and (len(group) + 1) * width > self.group_tokens:
                batch.decodes.append(self._decode_group(group))
                group = []
            group.append((flat, req))
        batch.decodes.append(self._decode_group(group))

    def _decode_group(self, decodes: list[tuple[int, Request]]) -> DecodeGroup:
        bs = self.block_size
        # Needed blocks only: a request may hold more than its context covers.
        lens = [r.num_computed_tokens + 1 for _, r in decodes]
        need = [-(-n // bs) for n in lens]
        width = max(need)
        # One tensor from padded rows: a tensor per row cost ~10 us each (0.8 ms at 64).
        tables = longs([r.block_ids[:k] + [0] * (width - k)
                        for (_, r), k in zip(decodes, need, strict=True)])
        return DecodeGroup.build([i for i, _ in decodes], tables, lens)
