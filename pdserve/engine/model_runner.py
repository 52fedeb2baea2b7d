"""Turns a schedule into one flat model batch, runs it, and samples."""

from __future__ import annotations

import torch

from pdserve.engine.request import Request, TopLogprobs
from pdserve.engine.sampler import Sampler
from pdserve.model.kv_cache import KVCache
from pdserve.model.llama import Batch, Chunk, LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, sampler: Sampler) -> None:
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.block_size = cache.shape.block_size

    def run(self, items: list[tuple[Request, int]]
            ) -> tuple[list[Request], list[int], list[float], list[TopLogprobs]]:
        """Compute the scheduled tokens; sample for requests whose known tokens are all
        computed now. Returns (sampled requests, their tokens, logprobs, top logprobs)."""
        batch, sampled = self.prepare(items)
        logits = self.model.forward(batch.to(self.cache.tensor.device), self.cache)
        if not sampled:
            return [], [], [], []
        # Sampling runs on the host: per-request seeded generators are CPU generators.
        return sampled, *self.sampler.sample(logits.cpu(), sampled)

    def prepare(self, items: list[tuple[Request, int]]) -> tuple[Batch, list[Request]]:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        logits_index: list[int] = []
        sampled: list[Request] = []
        decodes: list[tuple[int, Request]] = []
        chunks: list[Chunk] = []
        for req, n in items:
            start, flat = req.num_computed_tokens, len(ids)
            pos = range(start, start + n)
            ids += req.token_ids[start:start + n]
            positions += pos
            blocks += [req.block_ids[p // bs] for p in pos]
            if n == 1 and start > 0:
                decodes.append((flat, req))
            else:
                table = torch.tensor([req.block_ids[:-(-(start + n) // bs)]])
                chunks.append(Chunk(flat, flat + n, start, table))
            if start + n == len(req.token_ids):
                logits_index.append(flat + n - 1)
                sampled.append(req)
        pos_t = torch.tensor(positions)
        batch = Batch(torch.tensor(ids), pos_t, torch.tensor(blocks), pos_t % bs,
                      torch.tensor(logits_index, dtype=torch.long), chunks=chunks)
        if decodes:
            self._add_decodes(batch, decodes)
        return batch, sampled

    def _add_decodes(self, batch: Batch, decodes: list[tuple[int, Request]]) -> None:
        bs = self.block_size
        # Needed blocks only: a request may hold more than its context covers.
        lens = [r.num_computed_tokens + 1 for _, r in decodes]
        width = max(-(-n // bs) for n in lens)
        tables = torch.zeros(len(decodes), width, dtype=torch.long)
        for row, (_, r) in enumerate(decodes):
            need = -(-lens[row] // bs)
            tables[row, :need] = torch.tensor(r.block_ids[:need])
        batch.decode_index = torch.tensor([i for i, _ in decodes])
        batch.decode_tables = tables
        batch.decode_mask = (torch.arange(width * bs).unsqueeze(0)
                             < torch.tensor(lens).unsqueeze(1))[:, None, None, :]
