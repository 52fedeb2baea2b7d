"""Data parallelism: N engine ranks, each its own process with its own KV cache, NIXL
agent, engine id (`<id>_dp<rank>`) and side-channel port (base + rank), behind one API
server that sends each request to the rank with the least outstanding work.

Ranks talk to the server over local ZMQ (ipc) sockets, pickled messages: the server
pushes ("add", Request) / ("abort", id) / ("metrics", n) / ("expire_leases",) / ("stop",)
to each rank, and
every rank pushes ("ready", rank, info, summary) / ("error", rank, msg) / ("out", outputs) /
("metrics", n, families) back on one shared socket. A rank that dies fails its requests
with an error and gets no more until the server has started it again; one that cannot be
started again makes the server unhealthy (so that it is restarted)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import pickle
import tempfile
import threading
import time

import zmq
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric

from pdserve.config import ConfigError, EngineConfig, KVTransferConfig
from pdserve.engine.async_engine import StreamingClient
from pdserve.engine.dp_rank import RankSpec, run_rank
from pdserve.engine.request import Request, RequestOutput

log = logging.getLogger("pdserve.dp")
WATCH_EVERY_S = 0.5  # how often the reader looks for ranks that died
# A rank that dies again this soon after its restart is not restarted again: it would only
# fail every request sent its way.
RESTART_MIN_UPTIME_S = 10.0


class DPEngine(StreamingClient):
    def __init__(self, config: EngineConfig, kv: KVTransferConfig | None, size: int,
                 side_channel: tuple[str, int], start_timeout: float = 300) -> None:
        super().__init__()
        self._dir = tempfile.mkdtemp(prefix="pdserve-dp-")
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(f"ipc://{self._dir}/out")
        self._send_lock = threading.Lock()
        self.outstanding = [0] * size
        self.info: list[list[dict]] = [[]] * size  # per DP rank: its TP ranks' info
        self.summaries = [""] * size
        self._owner: dict[str, int] = {}
        self.dead: set[int] = set()  # not taking requests: restarting, or given up on
        self.given_up: set[int] = set()
        self._started: list[float] = [time.monotonic()] * size
        self._registry = CollectorRegistry()
        self.restarts = Counter("pdserve_engine_rank_restarts", "Engine ranks that died and "
                                "were started again", registry=self._registry)
        self._metrics: dict[int, tuple[asyncio.Future, list]] = {}
        self._metrics_seq = 0
        self._specs = [RankSpec(r, config, kv, side_channel, f"ipc://{self._dir}/in{r}",
                                f"ipc://{self._dir}/out") for r in range(size)]
        self._push = [self._inbox(spec) for spec in self._specs]
        self._procs = [self._spawn(spec) for spec in self._specs]
        self._await_ready(start_timeout)
        self._reader = threading.Thread(target=self._read, name="dp-reader", daemon=True)
        self._reader.start()

    def _inbox(self, spec: RankSpec) -> zmq.Socket:
        push = self._ctx.socket(zmq.PUSH)
        push.bind(spec.inbox)
        return push

    def _spawn(self, spec: RankSpec) -> mp.Process:
        # A daemonic process may not start children: tensor-parallel workers need one that is not.
        proc = mp.get_context("spawn").Process(
            target=run_rank, args=(spec,), name=f"engine-dp{spec.rank}",
            daemon=spec.config.tensor_parallel_size == 1)
        proc.start()
        return proc

    def _await_ready(self, timeout: float) -> None:
        deadline, pending = time.monotonic() + timeout, set(range(len(self._procs)))
        while pending:
            if not self._pull.poll(500):
                dead = [r for r in pending if not self._procs[r].is_alive()]
                if dead or time.monotonic() > deadline:
                    self.shutdown()
                    raise ConfigError(f"engine rank {dead[0] if dead else min(pending)} "
                                      "did not start (see its log above)")
                continue
            msg = pickle.loads(self._pull.recv())
            if msg[0] == "error":
                self.shutdown()
                raise ConfigError(f"engine rank {msg[1]}: {msg[2]}")
            _, rank, self.info[rank], self.summaries[rank] = msg
            pending.discard(rank)

    def _send(self, rank: int, msg: tuple) -> None:
        with self._send_lock:  # zmq sockets are not thread-safe
            try:  # never block on a rank that is gone
                self._push[rank].send(pickle.dumps(msg), zmq.NOBLOCK)
            except zmq.Again:
                if msg[0] != "stop":
                    log.error("engine rank %d is not reachable; dropped %s", rank, msg[0])

    def _add(self, req: Request) -> None:
        live = [r for r in range(len(self._procs)) if r not in self.dead]
        if not live:
            self._dispatch([_failed(req.request_id, "every engine rank has died")])
            return
        rank = min(live, key=self.outstanding.__getitem__)
        self._owner[req.request_id] = rank
        self.outstanding[rank] += 1
        self._send(rank, ("add", req))

    def _abort(self, request_id: str) -> None:
        if (rank := self._owner.get(request_id)) is not None:
            self._send(rank, ("abort", request_id))

    def expire_leases(self) -> None:
        for rank in range(len(self._procs)):
            self._send(rank, ("expire_leases",))

    def _done(self, request_id: str) -> None:
        if (rank := self._owner.pop(request_id, None)) is not None:
            self.outstanding[rank] -= 1

    async def metrics(self) -> bytes:
        """Every rank's metrics, merged into one exposition (labels tell them apart)."""
        loop = asyncio.get_running_loop()
        self._metrics_seq += 1
        seq, fut = self._metrics_seq, loop.create_future()
        self._metrics[seq] = (fut, [])
        for rank in self._live():
            self._send(rank, ("metrics", seq))
        try:
            families = await asyncio.wait_for(fut, timeout=10)
        finally:
            self._metrics.pop(seq, None)
        return generate_latest(_Families(_merge([*families, *self._registry.collect()])))

    def healthy(self) -> bool:
        return not self.given_up

    def describe(self) -> str:
        return "; ".join(self.summaries)

    def kv_info(self) -> list[dict]:
        return [rank for ranks in self.info for rank in ranks]

    def shutdown(self) -> None:
        for rank, proc in enumerate(self._procs):
            if proc.is_alive():
                self._send(rank, ("stop",))
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()

    def _live(self) -> list[int]:
        return [r for r in range(len(self._procs)) if r not in self.dead]

    def _read(self) -> None:
        watch = 0.0
        while True:
            if time.monotonic() >= watch:  # however busy the live ranks keep the socket
                self._watch()
                watch = time.monotonic() + WATCH_EVERY_S
            if not self._pull.poll(int(WATCH_EVERY_S * 1000)):
                continue
            msg = pickle.loads(self._pull.recv())
            if msg[0] == "ready":
                _, rank, self.info[rank], self.summaries[rank] = msg
                self.dead.discard(rank)
                log.info("engine rank %d is back", rank)
            elif msg[0] == "error":
                self._give_up(msg[1], msg[2])
            elif msg[0] == "out":
                self._dispatch(msg[1])
            elif msg[0] == "metrics" and (entry := self._metrics.get(msg[1])) is not None:
                fut, got = entry
                got.append(msg[2])
                if len(got) == len(self._live()):
                    fut.get_loop().call_soon_threadsafe(_resolve, fut, got)

    def _watch(self) -> None:
        """Fail the requests of ranks that died since the last look, and start them again."""
        for rank, proc in enumerate(self._procs):
            if proc.is_alive() or rank in self.given_up:
                continue
            why = f"engine rank {rank} died (exit code {proc.exitcode})"
            if rank in self.dead:  # before it was ready again
                self._give_up(rank, f"{why} while starting again")
                continue
            self.dead.add(rank)
            self._dispatch([_failed(rid, why) for rid, r in list(self._owner.items())
                            if r == rank])
            if time.monotonic() - self._started[rank] < RESTART_MIN_UPTIME_S:
                self._give_up(rank, f"{why} {RESTART_MIN_UPTIME_S:.0f}s after its start")
                continue
            log.error("%s; failed its requests, starting it again", why)
            self.restarts.inc()
            with self._send_lock:  # a fresh inbox: the old one may hold unread commands
                self._push[rank].close()
                self._push[rank] = self._inbox(self._specs[rank])
            self._procs[rank] = self._spawn(self._specs[rank])
            self._started[rank] = time.monotonic()

    def _give_up(self, rank: int, why: str) -> None:
        log.error("engine rank %d: %s; not restarting it: the server reports unhealthy",
                  rank, why)
        self.dead.add(rank)
        self.given_up.add(rank)


def _failed(request_id: str, error: str) -> RequestOutput:
    return RequestOutput(request_id, [], [], "", 0, 0, "error", error)


def _resolve(fut: asyncio.Future, got: list) -> None:
    if not fut.done():
        fut.set_result([f for families in got for f in families])


def _merge(families: list[Metric]) -> list[Metric]:
    merged: dict[str, Metric] = {}
    for fam in families:
        into = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
        into.samples.extend(fam.samples)
    return list(merged.values())


@dataclasses.dataclass(slots=True)
class _Families:
    families: list[Metric]

    def collect(self) -> list[Metric]:
        return self.families
