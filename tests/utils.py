"""Real processes for end-to-end tests: start a `pdserve` command on 127.0.0.1, wait until
it is healthy, read its metrics, stop it by PID."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def free_port(count: int = 1) -> int:
    """A port p such that p .. p+count-1 are all free on 127.0.0.1 now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count < 65000 and all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def start_server(args: list[str], url: str | None = None, timeout: float = 180,
                 env: dict[str, str] | None = None,
                 ready: Callable[[Server], bool] | None = None) -> Server:
    """Run `pdserve ARGS` in its own process group; `url` defaults to --port's."""
    if url is None:
        url = f"http://127.0.0.1:{args[args.index('--port') + 1]}"
    fd, log_path = tempfile.mkstemp(prefix="pdserve-", suffix=".log")
    with os.fdopen(fd, "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.entrypoints.cli", *args],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    server = Server(proc, url, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve {' '.join(args)} exited with {proc.returncode}:\n"
                               f"{server.log()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200 and \
                    (ready is None or ready(server)):
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"pdserve {' '.join(args)} not healthy in {timeout}s:\n"
                       f"{server.log()[-4000:]}")


def metric(url: str, name: str) -> float:
    """Sum of a Prometheus metric over its label sets."""
    text = httpx.get(url + "/metrics", timeout=10).text
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def wait_for_metric(url: str, name: str, value: float, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while (got := metric(url, name)) != value:
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} at {url} is {got}, expected {value}")
        time.sleep(0.1)
