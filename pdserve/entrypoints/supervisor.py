"""`pdserve up`'s watch over its instances: one that exits, or stops answering /health, is
started again after a pause that grows while it keeps failing; each restart is logged and
counted. The others serve on meanwhile (the proxy routes around a backend that is down)."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import httpx
from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("pdserve.up")
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # before the n-th restart in a row
STABLE_S = 60.0  # healthy this long after a start: the next restart waits BACKOFF_S[0] again
CHECK_EVERY_S = 2.0
PROBE_TIMEOUT_S = 5.0
# Failed /health checks in a row after which a running instance counts as hung: a step of
# a long prompt never keeps /health (its own thread) waiting for seconds.
MAX_FAILED_PROBES = 3


class Process(Protocol):
    """What the supervisor needs of an instance: its name, URL and liveness path, its
    process."""
    name: str
    url: str
    probe: str
    proc: subprocess.Popen | None


@dataclass(slots=True)
class Watched:
    inst: Process
    started: float = 0.0
    healthy_since: float | None = None  # since its start; None until /health said so
    failed_probes: int = 0
    streak: int = 0  # restarts in a row, each after less than STABLE_S of health
    restart_at: float | None = None  # it is down, to be started then


class Supervisor:
    """`check()` once in a while; `start` starts an instance's process, `kill` ends it."""

    def __init__(self, instances: list[Process], start: Callable[[Process], None],
                 kill: Callable[[Process], None], startup_timeout: float,
                 registry: CollectorRegistry | None = None) -> None:
        self.start, self.kill, self.startup_timeout = start, kill, startup_timeout
        now = time.monotonic()
        self.watched = [Watched(i, started=now) for i in instances]
        self.restarts = Counter("pdserve_up_restarts", "Instances restarted by pdserve up, "
                                "by instance and why", ["instance", "reason"],
                                registry=registry or CollectorRegistry())
        self._probes = ThreadPoolExecutor(max(len(instances), 1), thread_name_prefix="probe")
        self._next_probe = 0.0

    def check(self) -> None:
        """Restart what is due; find what died or hangs (probing every CHECK_EVERY_S)."""
        now = time.monotonic()
        probe = now >= self._next_probe
        if probe:
            self._next_probe = now + CHECK_EVERY_S
        up = [w for w in self.watched if w.restart_at is None]
        health = list(self._probes.map(_healthy, up)) if probe else [None] * len(up)
        for w, ok in zip(up, health, strict=True):
            self._judge(w, ok, now)
        for w in self.watched:
            if w.restart_at is not None and now >= w.restart_at:
                self._restart(w)

    def close(self) -> None:
        self._probes.shutdown(wait=False, cancel_futures=True)

    def _judge(self, w: Watched, ok: bool | None, now: float) -> None:
        if (code := w.inst.proc.poll()) is not None:
            self._down(w, f"exited with {code}", "exited", now)
        elif ok is None:
            return
        elif ok:
            w.failed_probes = 0
            if w.healthy_since is None:
                w.healthy_since = now
        elif w.healthy_since is None:  # still starting
            if now - w.started > self.startup_timeout:
                self._down(w, f"not healthy {self.startup_timeout:.0f}s after its start",
                           "unhealthy", now)
        else:
            w.failed_probes += 1
            if w.failed_probes >= MAX_FAILED_PROBES:
                self._down(w, f"failed {w.failed_probes} health checks in a row",
                           "unhealthy", now)

    def _down(self, w: Watched, why: str, reason: str, now: float) -> None:
        if w.inst.proc.poll() is None:
            self.kill(w.inst)
        stable = w.healthy_since is not None and now - w.healthy_since >= STABLE_S
        w.streak = 0 if stable else w.streak
        pause = BACKOFF_S[min(w.streak, len(BACKOFF_S) - 1)]
        w.streak += 1
        w.restart_at = now + pause
        self.restarts.labels(w.inst.name, reason).inc()
        log.error("%s %s; restarting it in %.0fs", w.inst.name, why, pause)

    def _restart(self, w: Watched) -> None:
        w.restart_at, w.healthy_since, w.failed_probes = None, None, 0
        w.started = time.monotonic()
        self.start(w.inst)


def _healthy(w: Watched) -> bool:
    try:
        return httpx.get(w.inst.url + w.inst.probe, timeout=PROBE_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False
