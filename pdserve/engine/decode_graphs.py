"""Decode steps replayed from CUDA graphs (issue 28).

A decode step of a small model on a GPU is launch-bound: ~500 kernels launched from Python
cost ~18 ms where the GPU reads the weights in well under 0.1 ms. A CUDA graph records one
step's launches once and replays them in one call. A graph replays fixed shapes at fixed
addresses, so decodes run padded: a step of n sequences and blocks up to w per table takes
the smallest captured batch size >= n and width >= w, fills the prefix of static input
buffers with its rows, and pads the rest with rows that read and write only a scratch KV
block that the allocator never hands out. Padding rows cannot change real rows: every row's
result depends on its own inputs alone (the tests check this).

Graphs are captured the first time a (batch, width) shape is needed and replayed after. The
width is a bucket too because attention on accelerators gathers each table's blocks: a graph
of the longest width would gather max_model_len tokens for every row.

Where no graph can be captured (CPU, or a capture that fails), the same padded path runs
eagerly: that is how CI tests it."""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

import torch

from pdserve.model.kv_cache import KVCache
from pdserve.model.llama import Batch, DecodeGroup, LlamaModel

log = logging.getLogger("pdserve.engine")

MAX_GRAPH_BATCH = 512  # nano-vllm's and vLLM's largest captured decode batch


def batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then every 16 up to max_num_seqs (and it)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [b for b in (1, 2, 4, 8) if b < top] + list(range(16, top, 16))
    return [*sizes, top]


def widths(max_blocks: int) -> list[int]:
    """The captured block-table widths: powers of two up to max_blocks (and it), so a row
    gathers at most twice the blocks it needs."""
    sizes = [1 << i for i in range(max_blocks.bit_length()) if 1 << i < max_blocks]
    return [*sizes, max_blocks]


def bucket(sizes: list[int], n: int) -> int:
    return sizes[bisect.bisect_left(sizes, n)]


@dataclass(slots=True)
class Decodes:
    """One decode step's rows: per sequence its token, position, the (block, offset) slot its
    K/V goes to, its context length (the token included) and its block table."""
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)

    def add(self, token: int, position: int, table: list[int], block_size: int) -> None:
        self.ids.append(token)
        self.positions.append(position)
        self.blocks.append(table[position // block_size])
        self.offsets.append(position % block_size)
        self.lens.append(position + 1)
        self.tables.append(table[:-(-(position + 1) // block_size)])

    @property
    def width(self) -> int:
        return max(map(len, self.tables))


class DecodeGraphs:
    """Padded decode steps for batches up to the largest of `batch_sizes(max_num_seqs)` and
    tables up to `max_blocks` wide; `scratch` is the KV block padding rows use. `capture`:
    record CUDA graphs (else every step runs the padded forward eagerly)."""

    def __init__(self, model: LlamaModel, cache: KVCache, max_num_seqs: int, max_blocks: int,
                 scratch: int, capture: bool) -> None:
        self.model, self.cache, self.scratch = model, cache, scratch
        self.sizes, self.widths = batch_sizes(max_num_seqs), widths(max_blocks)
        device = cache.tensor.device
        top, wide = self.sizes[-1], self.widths[-1]
        # ids, positions, slot blocks, slot offsets, lens: one host-to-device copy a step.
        self.rows = torch.zeros(5, top, dtype=torch.long, device=device)
        self.tables = torch.zeros(top * wide, dtype=torch.long, device=device)
        self.index = torch.arange(top, device=device)
        self.capture = capture
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.eager: set[tuple[int, int]] = set()  # shapes whose capture failed
        self.pool = None

    def fits(self, n: int, width: int) -> bool:
        return n <= self.sizes[-1] and width <= self.widths[-1]

    def run(self, d: Decodes) -> torch.Tensor:
        """The float32 logits [len(d.ids), vocab] of a step of these decodes."""
        n = len(d.ids)
        key = bucket(self.sizes, n), bucket(self.widths, d.width)
        self._fill(d, *key)
        if not self.capture or key in self.eager:
            return self._forward(*key)[:n]
        if key not in self.graphs:
            self._record(key)
            if key in self.eager:
                return self._forward(*key)[:n]
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:n]

    def _fill(self, d: Decodes, b: int, w: int) -> None:
        pad = b - len(d.ids)
        rows = torch.tensor([d.ids + [0] * pad, d.positions + [0] * pad,
                             d.blocks + [self.scratch] * pad, d.offsets + [0] * pad,
                             d.lens + [1] * pad])
        tables = torch.full((b, w), self.scratch, dtype=torch.long)
        for i, t in enumerate(d.tables):
            tables[i, :len(t)] = torch.tensor(t)
        self.rows[:, :b].copy_(rows, non_blocking=True)
        self.tables[:b * w].copy_(tables.flatten(), non_blocking=True)

    def _forward(self, b: int, w: int) -> torch.Tensor:
        """The padded forward on the static buffers' first b rows and w table columns: the
        code a graph of (b, w) records."""
        ids, positions, blocks, offsets, lens = self.rows[:, :b]
        tables = self.tables[:b * w].view(b, w)
        group = DecodeGroup(self.index[:b], tables, lens)
        batch = Batch(ids, positions, blocks, offsets, self.index[:b], decodes=[group])
        return self.model.forward(batch, self.cache)

    def _record(self, key: tuple[int, int]) -> None:
        """Capture the graph of shape `key` from the inputs just filled (a warm-up run on a
        side stream first, as CUDA graph capture requires); on failure that shape stays
        eager."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(*key)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self._forward(*key)
        except RuntimeError as e:
            log.warning("decode batch %d, width %d: no CUDA graph (%s); running eagerly",
                        *key, e)
            self.eager.add(key)
            return
        self.pool = graph.pool()
        self.graphs[key] = graph, logits
