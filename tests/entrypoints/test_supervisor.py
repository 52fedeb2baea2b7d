"""pdserve up's supervisor on real processes and a real /health endpoint (a tiny HTTP
server whose answer the test sets): exits and hangs are restarted, with a growing pause,
counted by reason; an instance still starting is left alone until its time is up.
`pdserve up` itself under kills: tests/e2e/test_healing.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry

from pdserve.entrypoints import supervisor
from pdserve.entrypoints.supervisor import Supervisor


@dataclass(slots=True)
class Inst:
    name: str
    url: str
    probe: str = "/health"
    proc: subprocess.Popen | None = None


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(type(self).status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_):
        pass


@pytest.fixture
def health():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Health.status = 200
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(supervisor, "BACKOFF_S", (0.2, 0.4, 0.8))
    monkeypatch.setattr(supervisor, "CHECK_EVERY_S", 0.05)
    monkeypatch.setattr(supervisor, "PROBE_TIMEOUT_S", 1.0)


def _start(inst: Inst) -> None:
    inst.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _kill(inst: Inst) -> None:
    inst.proc.kill()
    inst.proc.wait()


def _run(sup: Supervisor, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sup.check()
        time.sleep(0.02)


def _count(registry: CollectorRegistry, name: str, reason: str) -> float:
    return registry.get_sample_value("pdserve_up_restarts_total",
                                     {"instance": name, "reason": reason}) or 0.0


@contextmanager
def supervised(name: str, url: str, startup_timeout: float = 30
               ) -> Iterator[tuple[Inst, Supervisor, CollectorRegistry]]:
    """One instance (a sleeping process) under a Supervisor probing `url`."""
    inst = Inst(name, url)
    _start(inst)
    registry = CollectorRegistry()
    sup = Supervisor([inst], _start, _kill, startup_timeout, registry)
    try:
        yield inst, sup, registry
    finally:
        sup.close()
        _kill(inst)


def test_an_instance_that_exits_is_restarted_after_a_growing_pause(health):
    with supervised("decode0", health) as (inst, sup, registry):
        starts = []
        for _ in range(3):
            first = inst.proc
            first.kill()
            first.wait()
            killed = time.monotonic()
            while inst.proc is first:
                sup.check()
                time.sleep(0.01)
            starts.append(time.monotonic() - killed)
            _run(sup, 0.1)  # healthy again, not for long: the next exit backs off further
        assert inst.proc.poll() is None
        assert _count(registry, "decode0", "exited") == 3
    # Pauses of 0.2, 0.4 and 0.8 s (plus a check's latency).
    for got, want in zip(starts, (0.2, 0.4, 0.8), strict=True):
        assert want <= got < want + 0.5, starts


def test_a_hung_instance_is_killed_and_restarted(health):
    with supervised("prefill0", health) as (inst, sup, registry):
        _run(sup, 0.2)
        hung = inst.proc
        _Health.status = 503
        _run(sup, (supervisor.MAX_FAILED_PROBES + 2) * 0.05 + 0.2)
        assert hung.poll() is not None  # killed
        _Health.status = 200
        _run(sup, 0.5)
        assert inst.proc is not hung and inst.proc.poll() is None
        assert _count(registry, "prefill0", "unhealthy") == 1


def test_an_instance_still_starting_is_left_alone_until_its_time_is_up(health):
    _Health.status = 503  # not yet healthy
    with supervised("prefill1", health, startup_timeout=1.0) as (inst, sup, registry):
        starting = inst.proc
        _run(sup, 0.5)
        assert inst.proc is starting and starting.poll() is None
        _run(sup, 1.0)
        assert starting.poll() is not None
        assert _count(registry, "prefill1", "unhealthy") == 1
