"""Engine clients for the API server: stream a request's outputs to asyncio.

`AsyncEngine` runs one engine in this process; `DPEngine` (dp_engine.py) fronts several
engine ranks in their own processes. Both share the per-request streaming here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.request import Request, RequestOutput


class StreamingClient:
    """Per-request output queues; subclasses submit requests and feed `_dispatch`."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Submit `req` and yield its outputs until it finishes; closing the iterator
        early (client gone) aborts it."""
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[req.request_id] = (queue, asyncio.get_running_loop())
        self._add(req)
        finished = False
        try:
            while not finished:
                out: RequestOutput = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._abort(req.request_id)
            self._streams.pop(req.request_id, None)
            self._done(req.request_id)

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self._abort(request_id)

    async def idle(self) -> bool:
        """Nothing running, waiting or held for remote decodes, on every rank (as the
        metrics say, which covers ranks in other processes too)."""
        text = (await self.metrics()).decode()
        return not any(s.value for fam in text_string_to_metric_families(text)
                       if fam.name in _BUSY for s in fam.samples)

    def expire_leases(self) -> None:
        """End every lease on blocks held for remote decodes (the server is going away)."""
        raise NotImplementedError

    async def metrics(self) -> bytes:
        raise NotImplementedError

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their requests' queues (from any thread)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            if (stream := self._streams.get(out.request_id)) is not None:
                by_loop.setdefault(stream[1], []).append((stream[0], out))
        for loop, items in by_loop.items():  # one wake-up per step, not one per token
            loop.call_soon_threadsafe(_put_all, items)

    def _add(self, req: Request) -> None:
        raise NotImplementedError

    def _abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _done(self, request_id: str) -> None:
        """A request's stream closed (finished or aborted)."""

    def healthy(self) -> bool:
        return True


class AsyncEngine(StreamingClient):
    """`build` makes the engine on its loop's thread (engine_loop.py says why)."""

    def __init__(self, build: Callable[[], LLMEngine], registry: CollectorRegistry) -> None:
        super().__init__()
        self.registry = registry
        self.loop = EngineLoop(build, self._dispatch)
        self.engine = self.loop.engine

    def _add(self, req: Request) -> None:
        self.loop.add(req)

    def _abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def expire_leases(self) -> None:
        self.loop.expire_leases()

    async def metrics(self) -> bytes:
        return generate_latest(self.registry)

    def describe(self) -> str:
        return self.engine.describe()

    def kv_info(self) -> list[dict]:
        return self.engine.kv_info()

    def shutdown(self) -> None:
        self.loop.shutdown()
        self.engine.close()


_BUSY = ("pdserve_num_requests_running", "pdserve_num_requests_waiting",
         "pdserve_kv_blocks_held_for_remote")


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)
