"""The engine's step loop on its own thread: takes commands, steps while there is work,
hands each step's outputs to a callback, and sleeps when there is nothing to do.

The engine is built on that thread too, so that one thread alone runs torch: OpenMP keeps
a thread team per calling thread, and with a second team (the builder's) alive libgomp
counts more threads than cores and stops spinning between parallel regions, every one of
them then waiting out a futex wake-up: a 1-row decode step took 27-35 ms instead of 19-20
here, its GEMMs 110 us instead of 30 (docs/benchmarks.md)."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future

from pdserve.engine import core_loan
from pdserve.engine.engine import LLMEngine
from pdserve.engine.heap import freeze_heap
from pdserve.engine.request import Request, RequestOutput

log = logging.getLogger("pdserve.engine")


class EngineLoop:
    """`build` makes the engine, on the loop's thread; the constructor returns once it is
    built, or raises what building raised."""

    engine: LLMEngine  # set by the loop's thread before the constructor returns

    def __init__(self, build: Callable[[], LLMEngine],
                 deliver: Callable[[list[RequestOutput]], None],
                 idle_poll_s: float = 0.05) -> None:
        self.deliver = deliver
        self.idle_poll_s = idle_poll_s
        self._inbox: list[tuple[str, object]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        built = Future()
        self._thread = threading.Thread(target=self._build_and_run, args=(build, built),
                                        name="engine-loop", daemon=True)
        self._thread.start()
        built.result()

    def _build_and_run(self, build: Callable[[], LLMEngine], built: Future) -> None:
        try:
            engine = build()
        except BaseException as e:  # the constructor raises it in the caller's thread
            built.set_exception(e)
            return
        self.lender, self.borrower = core_loan.from_env(engine.dp_rank)
        if self.borrower is not None:  # (only single-rank engines borrow)
            engine.set_checkpoint(self.borrower.take)
        freeze_heap()
        self.engine = engine
        built.set_result(None)
        self._run()

    def add(self, req: Request) -> None:
        self._submit("add", req)

    def abort(self, request_id: str) -> None:
        self._submit("abort", request_id)

    def expire_leases(self) -> None:
        self._submit("expire_leases", None)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _submit(self, kind: str, item: object) -> None:
        with self._lock:
            self._inbox.append((kind, item))
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            if early := self._drain_inbox():  # a remote prefill's first token goes out now
                self.deliver(early)
            outputs: list[RequestOutput] = []
            computed = False
            work = self.engine.has_work()
            busy = work or self.engine.kv_busy()
            self._before_step(work, busy)
            start = time.monotonic()
            if busy:
                try:
                    outputs += self.engine.step()
                    computed = self.engine.last_step_computed
                except Exception:
                    outputs += self._fail_all(traceback.format_exc())
            if self.borrower is not None:
                if computed and self.borrower.borrowed:
                    self.engine.metrics.loan_steps.inc()
                self.borrower.after_step()
            if outputs:
                self.deliver(outputs)
            if computed:
                # A decode that prefilled a prompt itself (conditional disaggregation) keeps
                # its core: lending would double that long step's stall of its streams.
                if self.lender is not None and not self.engine.last_step_prefilled and (
                        lent := self.lender.after_step(time.monotonic() - start)):
                    self.engine.metrics.loan_lent.inc(lent)
            elif not outputs:  # nothing ran: sleep until work arrives or a poll is due
                self._wake.wait(self.engine.idle_timeout(self.idle_poll_s))
                self._wake.clear()

    def _before_step(self, work: bool, busy: bool) -> None:
        """Settle the core loans: lend what this step will not use (and take it back from a
        borrower first if it will), then borrow what is lent now."""
        if self.lender is not None:
            # Held blocks awaiting a pull keep an engine busy polling, but compute nothing.
            self.lender.before_step(work)
        if self.borrower is not None:
            self.borrower.before_step(busy, self.engine.num_unfinished)

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        outputs: list[RequestOutput] = []
        for kind, item in inbox:
            if kind == "add":
                outputs += self.engine.add_request(item)
            elif kind == "expire_leases":
                self.engine.end_leases()
            elif (out := self.engine.abort_request(item)) is not None:
                outputs.append(out)
        return outputs

    def _fail_all(self, trace: str) -> list[RequestOutput]:
        log.error("engine step failed; failing its requests:\n%s", trace)
        return self.engine.fail_all(f"internal error: {trace.strip().splitlines()[-1]}")
