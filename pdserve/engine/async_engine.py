"""Runs the engine's step loop in its own thread and streams outputs to asyncio callers."""

from __future__ import annotations

import asyncio
import logging
import threading
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import Request, RequestOutput

log = logging.getLogger("pdserve.engine")


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_poll_s: float = 0.05) -> None:
        self.engine = engine
        self.idle_poll_s = idle_poll_s
        self._inbox: list[tuple[str, object]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Submit `req` and yield its outputs until it finishes; closing the iterator
        early (client gone) aborts it."""
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        self._streams[req.request_id] = stream
        self._submit("add", req)
        finished = False
        try:
            while not finished:
                out: RequestOutput = await stream.queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._submit("abort", req.request_id)
            self._streams.pop(req.request_id, None)

    def call(self, fn) -> None:
        """Run fn(engine) on the engine thread (e.g. to read state consistently)."""
        self._submit("call", fn)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _submit(self, kind: str, item: object) -> None:
        with self._lock:
            self._inbox.append((kind, item))
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopped:
            outputs = self._drain_inbox()
            computed = False
            if self.engine.has_work() or self._connector_busy():
                try:
                    outputs += self.engine.step()
                    computed = self.engine.last_step_computed
                except Exception:
                    outputs += self._fail_all(traceback.format_exc())
            self._deliver(outputs)
            if not computed and not outputs:  # nothing ran: sleep until work or a poll is due
                self._wake.wait(self._idle_timeout())
                self._wake.clear()

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        outputs: list[RequestOutput] = []
        for kind, item in inbox:
            if kind == "add":
                outputs += self.engine.add_request(item)
            elif kind == "abort":
                if (out := self.engine.abort_request(item)) is not None:
                    outputs.append(out)
            else:
                item(self.engine)
        return outputs

    def _connector_busy(self) -> bool:
        c = self.engine.connector
        return c is not None and c.busy()

    def _idle_timeout(self) -> float:
        c = self.engine.connector
        return self.idle_poll_s if c is None else min(self.idle_poll_s, c.poll_interval())

    def _fail_all(self, trace: str) -> list[RequestOutput]:
        log.error("engine step failed; failing its requests:\n%s", trace)
        error = trace.strip().splitlines()[-1]
        return [self.engine.fail_request(r, f"internal error: {error}")
                for r in list(self.engine.requests.values())]

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outputs:
            if (stream := self._streams.get(out.request_id)) is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():  # one wake-up per step, not one per token
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)
