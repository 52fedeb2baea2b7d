"""Continuous batching with chunked prefill and recompute preemption.

Every step spends a budget of prompt tokens: running requests first (an unfinished prefill
its next chunk; a decode's one token is scheduled outside the budget), then waiting ones.
A request whose KV comes from a remote prefill gets its blocks and waits in
WAITING_FOR_REMOTE_KV until the pull lands.
A request admitted starts from the longest prefix of its tokens already in the prefix cache
(full blocks it shares by reference), and its own full blocks join the cache once computed."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.config import EngineConfig
from pdserve.engine.block_allocator import BlockAllocator, chain_hashes
from pdserve.engine.request import Request, Status


@dataclass(slots=True)
class Schedule:
    items: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    to_load: list[Request] = field(default_factory=list)  # blocks ready for a remote pull
    preempted: list[Request] = field(default_factory=list)
    cache_queries: int = 0  # tokens looked up in the prefix cache
    cache_hits: int = 0  # of those, tokens found


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: BlockAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> Schedule:
        out = Schedule()
        # The budget bounds a step's prompt tokens (its chunked prefill). A decode's one
        # token rides along outside it: a prompt is not split for the decodes beside it
        # (a 512-token prompt took two steps while anything decoded), and no decode waits a
        # step behind an earlier request's prompt chunk.
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running):
            req = self.running[i]
            decode = self._decoding(req)
            n = 1 if decode else self._num_new(req, budget)
            if n == 0:  # the budget is spent: its next chunk waits for the next step
                i += 1
                continue
            if not self._reserve(req, n, out):
                break  # req itself was preempted
            out.items.append((req, n))
            budget -= 0 if decode else n
            i += 1
        while self.waiting and budget > 0 and self._slots_left():
            if (n := self._admit(self.waiting[0], budget, out)) is None:
                break
            budget -= n
        return out

    def admit_loads(self) -> Schedule:
        """Admit the remote-KV requests at the head of the queue now (they need blocks and a
        slot, no compute), so their pulls can land before the step is scheduled."""
        out = Schedule()
        while self.waiting and self.waiting[0].load_remote and self._slots_left() and \
                self._admit(self.waiting[0], 0, out) is not None:
            pass
        return out

    def _admit(self, req: Request, budget: int, out: Schedule) -> int | None:
        """Move the queue's head to running (or loading); the tokens it spends, or None
        if its blocks do not fit."""
        hit = self._take_cached_prefix(req)
        n = 0 if req.load_remote else self._num_new(req, budget)
        if not self._grow(req, req.num_prompt_tokens if req.load_remote
                          else req.num_computed_tokens + n):
            self._drop_cached_prefix(req, hit)
            return None
        self.waiting.popleft()
        if hit >= 0:
            out.cache_queries += len(req.token_ids)
            out.cache_hits += req.num_cached_tokens
        if req.load_remote:
            req.status = Status.WAITING_FOR_REMOTE_KV
            self.loading[req.request_id] = req
            out.to_load.append(req)
            return 0
        req.status = Status.RUNNING
        self.running.append(req)
        out.items.append((req, n))
        return n

    def cache_computed(self, req: Request) -> None:
        """Offer the request's newly computed full blocks to the prefix cache."""
        full = req.num_computed_tokens // self.config.block_size
        if full <= req.num_registered_blocks or not self.allocator.prefix_caching or \
                not req.shareable:
            return
        hashes = chain_hashes(req.token_ids, self.config.block_size, req.block_hashes, full)
        for i in range(req.num_registered_blocks, full):
            self.allocator.cache(req.block_ids[i], hashes[i])
        req.num_registered_blocks = full

    def loaded(self, req: Request, ok: bool, recompute_last: bool = False) -> None:
        """A remote pull ended: the prompt is computed, or (failed) must be recomputed.
        recompute_last: the prefill sent no first token, so the last prompt token is run
        here to sample it."""
        self.loading.pop(req.request_id, None)
        if ok:
            req.num_computed_tokens = req.num_prompt_tokens - int(recompute_last)
            req.status = Status.RUNNING
            self.running.append(req)
            self.cache_computed(req)
        else:  # recompute what the cache did not hold (the pull may have half-written it)
            req.num_computed_tokens = req.num_cached_tokens
            req.load_remote = False
            req.status = Status.WAITING
            self.waiting.appendleft(req)

    def remove(self, req: Request) -> None:
        """Take a finished or aborted request out of every queue (blocks stay with it)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.loading.pop(req.request_id, None)

    def _slots_left(self) -> bool:
        return len(self.running) + len(self.loading) < self.config.max_num_seqs

    @staticmethod
    def _decoding(req: Request) -> bool:
        """Its prompt is computed and one sampled token is not: a plain decode."""
        return req.num_computed_tokens >= req.num_prompt_tokens and \
            len(req.token_ids) - req.num_computed_tokens == 1

    def _num_new(self, req: Request, budget: int) -> int:
        # A prompt is prefilled in chunks that stop at its end, so its KV (and what a
        # remote prefill computes) is the same whatever follows it.
        end = len(req.token_ids)
        if req.num_computed_tokens < req.num_prompt_tokens:
            end = req.num_prompt_tokens
        return min(end - req.num_computed_tokens, budget)

    def _take_cached_prefix(self, req: Request) -> int:
        """Start a request without blocks at its longest cached prefix; returns the blocks
        taken, or -1 if nothing was looked up (it had blocks, or caching is off)."""
        # Positions served from the cache have no logits: a request still owing prompt
        # logprobs computes its whole prompt (as vLLM does).
        if req.block_ids or not self.allocator.prefix_caching or req.needs_prompt_logprobs:
            return -1
        bs = self.config.block_size
        # Only blocks before the first token this request will run: a shared block is
        # never written. That is its last known token (a remote prefill's first output
        # token, when it sent one, is the first one run on decode).
        usable = (len(req.token_ids) - 1) // bs
        hashes = chain_hashes(req.token_ids, bs, req.block_hashes, usable)
        req.block_ids = self.allocator.lookup(hashes[:usable])
        req.num_cached_tokens = req.num_computed_tokens = len(req.block_ids) * bs
        req.num_registered_blocks = len(req.block_ids)
        return len(req.block_ids)

    def _drop_cached_prefix(self, req: Request, hit: int) -> None:
        """Undo _take_cached_prefix for a request that could not be admitted."""
        if hit > 0:
            self.allocator.free(req.block_ids)
            req.block_ids = []
            req.num_cached_tokens = req.num_computed_tokens = req.num_registered_blocks = 0

    def _reserve(self, req: Request, n: int, out: Schedule) -> bool:
        """Grow `req` to hold n more tokens, preempting the newest running requests."""
        while not self._grow(req, req.num_computed_tokens + n):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = -(-num_tokens // self.config.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        req.block_ids += self.allocator.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        self.allocator.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = req.num_cached_tokens = req.num_registered_blocks = 0
        req.shareable = True  # recomputed here, whole
        req.load_remote = False  # its pulled KV is gone with its blocks: recompute it here
        req.status = Status.WAITING
        self.waiting.appendleft(req)

