"""Start `pdserve` layouts for benchmarks and stop them again."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

_GIVEN: set[int] = set()


def free_port(count: int = 1) -> int:
    """A port p with p .. p+count-1 free on 127.0.0.1, below the kernel's ephemeral range:
    a port from that range can be taken as the source port of any outgoing connection
    between now and the server binding it."""
    low = _ephemeral_low()
    top = low if low - count > 20000 else 65000  # no room below it: take what is free
    while True:
        ports = range(base := random.randrange(10000, top - count), base + count)
        # Not one handed out before either: its server may not have bound it yet.
        if not _GIVEN.intersection(ports) and all(_free(p) for p in ports):
            _GIVEN.update(ports)
            return base


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@contextmanager
def launched(args: list[str], health_urls: list[str], timeout: float = 300,
             log: Path | None = None):
    """Run `pdserve ARGS` in its own process group until the block ends."""
    with running([sys.executable, "-m", "pdserve.entrypoints.cli", *args], health_urls,
                 timeout, log=log) as proc:
        yield proc


@contextmanager
def running(cmd: list[str], health_urls: list[str], timeout: float = 300,
            env: dict[str, str] | None = None, name: str = "pdserve", log: Path | None = None):
    """Run `cmd` (a server: pdserve, or a baseline) in its own process group until the block
    ends, once every URL's /health answers 200; its log to `log`, else to our stderr."""
    with open(log, "w") if log else contextlib.nullcontext() as err:
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=err or subprocess.DEVNULL,
                                stderr=err, env=env)
    try:
        _wait(proc, health_urls, timeout, name)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait(proc: subprocess.Popen, urls: list[str], timeout: float, name: str) -> None:
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} during start-up")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not healthy after {timeout}s: {', '.join(pending)}")
        try:
            if httpx.get(pending[0] + "/health", timeout=2).status_code == 200:
                pending.pop(0)
                continue
        except httpx.TransportError:
            pass
        time.sleep(0.3)


def up_layout(extra: list[str] | None = None) -> tuple[list[str], str, str, str]:
    """argv for `pdserve up` on fresh ports, and its proxy, prefill and decode URLs."""
    port, base, side = free_port(), free_port(count=2), free_port(count=2)
    argv = ["up", "--port", str(port), "--base-port", str(base),
            "--side-channel-base-port", str(side), *(extra or [])]
    url = "http://127.0.0.1:{}"
    return argv, url.format(port), url.format(base), url.format(base + 1)
