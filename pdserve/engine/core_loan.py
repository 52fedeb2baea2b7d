"""Cores that engines on the same host lend each other: a decode to its prefill, and a
prefill to its lone decode.

`pdserve up` gives each decode rank a core of its own, so that its steps never wait behind
a prefill; but a decode with nothing to decode leaves that core idle, while a prefill on
one core takes nearly twice as long as on two. So each decode engine (a `Lender`)
publishes, in its byte of a small shared file (the board), how many threads it lends (0
while it has work), and the prefill engine (the `Borrower`) reads the board before each
step and at the model's checkpoints (before each layer's attention and each MLP GEMM, a few
ms apart), and runs what follows on its own threads plus the lent cores. While a part runs
on lent cores the borrower raises a flag on the board; a lender that gets work waits for it
to drop before it steps, so neither ever waits on a thread that shares the other's core.

While the prefill has a backlog (PACE_DEMAND prompts or more), a busy decode lends too: after
each step it leaves its core to the prefill for as long as the step took, so decoding takes
half its core and its batch grows to keep up, at about twice the inter-token latency.

The other way round, on a second board, an idle prefill lends its cores to the decode it
serves alone: a decode step on two threads takes 0.65-0.75 of its time on one, which
shortens every lone request's decode and the tail of a burst, where the prompts are done
and the decodes are not. The decode checks at the same checkpoints (a layer is well under a
ms in a decode), so a prompt that arrives gets its cores back at once.

`pdserve up` sets PDSERVE_CORE_LOAN (JSON) in the instances' environment, each part
optional: `{"lend": {"board": path, "slot": i, "threads": n, "paced": bool}, "borrow":
{"board": path, "cpus": [cpu, ...]}}` (rank r of a lender writes slot i + r; only a paced
lender lends while busy)."""

from __future__ import annotations

import json
import mmap
import os
import time
from dataclasses import dataclass

import torch

ENV = "PDSERVE_CORE_LOAN"
# The board: what the borrower needs and does, then a byte per lender.
DEMAND, BORROWING, LENDERS = 0, 1, 2  # requests the borrower holds; 1 while a layer borrows
PACE_DEMAND = 3  # a paced lender lends from this backlog on: one prompt running, two waiting
RECLAIM_TIMEOUT_S = 0.05  # a lender waits no longer for a layer to end (a borrower gone)


@dataclass(slots=True)
class Lender:
    """An engine's byte on its borrower's board: the threads it lends now."""
    board: mmap.mmap
    slot: int
    lend: int
    paced: bool  # lends between its own steps while the borrower has a backlog
    published: int = -1

    def before_step(self, busy: bool) -> None:
        self._publish(0 if busy else self.lend)
        if busy:
            self._reclaim()

    def after_step(self, step_s: float) -> float:
        """Lend the core for as long as the step took while the borrower has a backlog;
        returns the seconds lent."""
        if not self.paced or self.board[DEMAND] < PACE_DEMAND:
            return 0.0
        self._publish(self.lend)
        time.sleep(step_s)
        return step_s

    def _publish(self, lent: int) -> None:
        if lent != self.published:
            self.board[self.slot] = self.published = lent

    def _reclaim(self) -> None:
        """Wait for the borrower's layer on this core to end."""
        deadline = time.monotonic() + RECLAIM_TIMEOUT_S
        while self.board[BORROWING] and time.monotonic() < deadline:
            time.sleep(0.0002)


@dataclass(slots=True)
class Borrower:
    """An engine's own cores and threads, plus what lenders offer now."""
    board: mmap.mmap
    own: set[int]
    lent: set[int]
    threads: int
    current: int = -1
    borrowed: bool = False  # did the step in progress run on lent cores?

    def before_step(self, busy: bool, demand: int) -> None:
        self.board[DEMAND] = min(demand, 255)
        self.borrowed = False
        if busy:
            self.take()
        else:
            self._use(self.threads)

    def after_step(self) -> None:
        """Off the lent cores between steps: a lender that gets work then finds them free,
        however long this engine waits for its next step."""
        self._use(self.threads)

    def take(self) -> None:
        """Runs what follows on its own threads plus those lent now. Called before each
        step and at the model's checkpoints: a lender that lends (or takes its core back)
        mid-step is used (or left) from the next part on."""
        threads = self.threads + min(sum(self.board[LENDERS:]), len(self.lent))
        self._use(threads)
        self.borrowed |= threads > self.threads

    def _use(self, threads: int) -> None:
        self.board[BORROWING] = threads > self.threads
        if threads != self.current:
            # This thread runs the step: off the lent cores unless it borrows them (the
            # OpenMP workers it starts inherit that, and sit idle when not asked for).
            os.sched_setaffinity(0, self.own | self.lent if threads > self.threads
                                 else self.own)
            torch.set_num_threads(threads)
            self.current = threads


def from_env(dp_rank: int = 0) -> tuple[Lender | None, Borrower | None]:
    """This engine's parts in core loans, from PDSERVE_CORE_LOAN: what it lends, what it
    borrows (None for a part it has not)."""
    spec = json.loads(os.environ.get(ENV) or "{}")
    lender = borrower = None
    if lend := spec.get("lend"):
        lender = Lender(_open(lend["board"]), LENDERS + lend["slot"] + dp_rank,
                        lend["threads"], lend["paced"])
    if borrow := spec.get("borrow"):
        lent = set(borrow["cpus"])
        borrower = Borrower(_open(borrow["board"]), os.sched_getaffinity(0) - lent, lent,
                            torch.get_num_threads())
    return lender, borrower


def _open(path: str) -> mmap.mmap:
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), 0)


def new_board(path: str, slots: int) -> None:
    """A board of `slots` lenders, all busy (lending nothing) until they say otherwise."""
    with open(path, "wb") as f:
        f.write(bytes(LENDERS + slots))
