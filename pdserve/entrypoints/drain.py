"""Graceful shutdown. SIGTERM starts a drain: new requests get 503 and /health says
"draining"; running requests may finish for up to --drain-timeout seconds, then the rest
are aborted; blocks still held for remote decodes are freed (their leases end now); then
the server exits 0. A second signal (or SIGINT) exits at once."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from pdserve.entrypoints.api_server import ServerState

log = logging.getLogger("pdserve.drain")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, timeout: float) -> None:
        super().__init__(config)
        self.state, self.timeout = state, timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # Not uvicorn's handling: it would close the port (no 503s) and re-raise SIGTERM
        # at exit (no exit status 0).
        if sig == signal.SIGTERM and self._drain is None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._start)
            return
        super().handle_exit(sig, frame)

    def _start(self) -> None:
        self._drain = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            await drain(self.state, self.timeout)
        finally:
            self.should_exit = True


async def drain(state: ServerState, timeout: float, poll_s: float = 0.1) -> None:
    adm, engine = state.admission, state.engine
    adm.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    log.info("draining: %d requests in flight; new requests get 503; up to %gs",
             adm.in_flight, timeout)
    while not await _quiet(state) and loop.time() < deadline:
        await asyncio.sleep(poll_s)
    if adm.in_flight:
        log.warning("drain: %gs passed, aborting %d requests", timeout, adm.in_flight)
        engine.abort_all()
    engine.expire_leases()  # no decode will read them from a server that is going away
    end = loop.time() + 10  # the aborts and frees are a step or two away
    while not await _quiet(state) and loop.time() < end:
        await asyncio.sleep(poll_s)
    log.info("drained; exiting")


async def _quiet(state: ServerState) -> bool:
    return state.admission.in_flight == 0 and await state.engine.idle()
