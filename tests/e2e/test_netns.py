"""P/D across a real network: the prefill in network namespace A, the decode and a proxy in
namespace B, joined only by a veth pair with a private /30 made inside them. The KV goes
over UCX/TCP across the veth; output is token-identical to a monolithic server."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import MODEL, kv_config, serve
from tests.utils import Server, free_port, metric

ADDR_A, ADDR_B = "10.213.7.1", "10.213.7.2"
TAG = f"{os.getpid() % 100000}"
NS_A, NS_B = f"pdtestA{TAG}", f"pdtestB{TAG}"
VETH_A, VETH_B = f"pdv{TAG}a", f"pdv{TAG}b"
CLONE_NEWNET = 0x40000000
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three colours and explain why the sky looks blue during the day. " * 4,
    "Q: A train leaves at 9:40 and arrives at 13:15. How long is the journey?\nA:",
    "Photosynthesis converts light energy into chemical energy stored in glucose. " * 6,
    [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 2060, 28, 4215, 30, 378, 3458, 282],
    "In 1969 the Apollo 11 mission landed on the Moon; ",
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, " * 10,
]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _make_namespaces() -> None:
    """Two namespaces and a veth between them; pytest.skip naming what is missing."""
    if shutil.which("ip") is None:
        subprocess.run(["apt-get", "install", "-y", "iproute2"], capture_output=True,
                       timeout=300)
        if shutil.which("ip") is None:
            pytest.skip("no `ip` (iproute2) and apt-get could not install it")
    if (r := _ip("netns", "add", NS_A)).returncode != 0:
        pytest.skip(f"cannot create a network namespace (needs CAP_SYS_ADMIN): {r.stderr}")
    steps = [("netns", "add", NS_B),
             ("link", "add", VETH_A, "type", "veth", "peer", "name", VETH_B),
             ("link", "set", VETH_A, "netns", NS_A), ("link", "set", VETH_B, "netns", NS_B)]
    for ns, dev, addr in ((NS_A, VETH_A, ADDR_A), (NS_B, VETH_B, ADDR_B)):
        steps += [("-n", ns, "addr", "add", f"{addr}/30", "dev", dev),
                  ("-n", ns, "link", "set", dev, "up"), ("-n", ns, "link", "set", "lo", "up")]
    for step in steps:
        if (r := _ip(*step)).returncode != 0:
            raise RuntimeError(f"ip {' '.join(step)}: {r.stderr}")


def _remove_namespaces() -> None:
    for ns in (NS_A, NS_B):  # deleting a namespace deletes its end of the veth, and the pair
        _ip("netns", "del", ns)


def _enter(ns: str) -> None:
    """Move the calling thread into network namespace `ns` (setns is per thread)."""
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        os.close(fd)


class InNamespace:
    """Runs client calls from a thread inside a namespace."""

    def __init__(self, ns: str) -> None:
        self.pool = ThreadPoolExecutor(1, initializer=_enter, initargs=(ns,))

    def __call__(self, fn: Callable, *args) -> Any:
        return self.pool.submit(fn, *args).result()


def _start(ns: str, client: InNamespace, url: str, args: list[str],
           env: dict[str, str]) -> Server:
    fd, log_path = tempfile.mkstemp(prefix="pdserve-netns-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m",
                                 "pdserve.entrypoints.cli", *args], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **env})
    server = Server(proc, url, log_path)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{args[0]} in {ns} exited:\n{server.log()[-3000:]}")
        try:
            if client(httpx.get, url + "/health").status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"{args[0]} in {ns} not healthy:\n{server.log()[-3000:]}")


def _rx_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", dev], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)[0]["stats64"]["rx"]["bytes"]


def _complete(url: str, prompt) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.fixture(scope="module")
def netns_pd():
    mono = serve()
    servers: list[Server] = [mono]
    in_b = None
    try:
        _make_namespaces()
        in_b = InNamespace(NS_B)
        kv = json.loads(kv_config(handshake_timeout=5))
        # UCX over TCP on the veth only: cma/shared memory would bypass the network.
        ucx = {"UCX_TLS": "tcp,self"}
        p_port, d_port, x_port = free_port(), free_port(), free_port()
        prefill = _start(NS_A, in_b, f"http://{ADDR_A}:{p_port}", [
            "serve", "--dtype", "float32", "--kv-cache-memory", "0.2", "--host", ADDR_A,
            "--port", str(p_port), "--kv-transfer-config", json.dumps(kv),
            "--kv-side-channel-host", ADDR_A, "--kv-side-channel-port", str(free_port())],
            {**ucx, "UCX_NET_DEVICES": VETH_A})
        servers.append(prefill)
        kv["kv_connector_extra_config"]["allowed_remote_hosts"] = [ADDR_A]
        decode = _start(NS_B, in_b, f"http://127.0.0.1:{d_port}", [
            "serve", "--dtype", "float32", "--kv-cache-memory", "0.2", "--port", str(d_port),
            "--kv-transfer-config", json.dumps(kv), "--kv-side-channel-port",
            str(free_port())], {**ucx, "UCX_NET_DEVICES": VETH_B})
        servers.append(decode)
        front = _start(NS_B, in_b, f"http://127.0.0.1:{x_port}", [
            "proxy", "--port", str(x_port), "--prefill", prefill.url, "--decode", decode.url],
            {})
        servers.append(front)
        yield mono, prefill, decode, front, in_b
    finally:
        for s in reversed(servers):
            s.stop()
        if in_b is not None:  # its thread holds namespace B open
            in_b.pool.shutdown()
        _remove_namespaces()


def test_pd_across_a_veth_matches_monolithic(netns_pd, reliability_row):
    mono, prefill, decode, front, in_b = netns_pd
    row = reliability_row("P/D across a network", f"prefill in netns A ({ADDR_A}), decode + "
                          f"proxy in netns B ({ADDR_B}), one veth /30, UCX over TCP; 8 prompts",
                          "token-identical to monolithic; the KV crosses the veth")
    before = in_b(metric, decode.url, "pdserve_kv_transfer_bytes_total")
    rx_before = _rx_bytes(NS_B, VETH_B)
    for prompt in PROMPTS:
        want, got = _complete(mono.url, prompt), in_b(_complete, front.url, prompt)
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"], prompt
        assert got["text"] == want["text"]
    moved = in_b(metric, decode.url, "pdserve_kv_transfer_bytes_total") - before
    received = _rx_bytes(NS_B, VETH_B) - rx_before
    assert in_b(metric, decode.url, "pdserve_kv_transfers_total") == len(PROMPTS)
    assert moved > 0 and received >= moved, (moved, received)
    assert in_b(metric, decode.url, "pdserve_prompt_tokens_computed_total") == 0
    row.observed(f"8/8 token-identical; {moved / 1e6:.1f} MB of KV pulled, "
                 f"{received / 1e6:.1f} MB received on B's veth; decode computed 0 prompt "
                 "tokens")


def test_prefill_listens_on_the_veth_address_only(netns_pd, reliability_row):
    row = reliability_row("bind addresses across a network", "`ss -ltn` inside netns A",
                          f"HTTP, side channel and UCX listen on {ADDR_A} only")
    out = subprocess.run(["ip", "netns", "exec", NS_A, "ss", "-Hltn"], check=True,
                         capture_output=True, text=True).stdout
    local = sorted(line.split()[3] for line in out.splitlines())
    _, prefill, _, _, in_b = netns_pd
    info = in_b(httpx.get, prefill.url + "/v1/kv_transfer/info").json()["ranks"][0]
    assert f"{ADDR_A}:{info['side_channel_port']}" in local, local
    assert all(a.startswith(f"{ADDR_A}:") for a in local), local
    row.observed(f"{len(local)} listening sockets, all on {ADDR_A} (side channel among them)")


def test_a_backend_gone_from_the_network_ends_the_stream(netns_pd, reliability_row):
    """A backend whose network vanishes sends no FIN and no RST: without TCP keepalive the
    proxy would wait for its stream forever. Run last: it takes netns A's link down."""
    row = reliability_row("backend gone from the network mid-stream", "a proxy in netns B "
                          "(--backend-keepalive 1) streaming from an instance in netns A; A's "
                          "end of the veth taken down mid-stream",
                          "the stream ends with an SSE error event and [DONE] within seconds")
    _, prefill, _, _, in_b = netns_pd
    port = free_port()
    # Every prompt straight to A's instance (as a decode that prefills it itself).
    front = _start(NS_B, in_b, f"http://127.0.0.1:{port}", [
        "proxy", "--port", str(port), "--prefill", prefill.url, "--decode", prefill.url,
        "--local-prefill-below", "100000", "--backend-keepalive", "1"], {})
    try:
        events, cut = in_b(_stream_cut_midway, front.url)
    finally:
        _ip("-n", NS_A, "link", "set", VETH_A, "up")
        front.stop()
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == 502 and "failed mid-stream" in error["message"], error
    assert cut < 15, cut  # keepalive: 1 s of silence, then 3 probes 1 s apart
    row.observed(f"{len(events) - 2} chunks, then the link went down; error event "
                 f"{error['message']!r} and [DONE] {cut:.1f}s later")


def _stream_cut_midway(url: str) -> tuple[list[str], float]:
    """Stream a long completion; after a few chunks take netns A's link down. The SSE data
    lines, and the seconds from the cut to the end of the stream."""
    events: list[str] = []
    cut_at = None
    with httpx.stream("POST", url + "/v1/completions", timeout=httpx.Timeout(60), json={
            "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
            if len(events) == 5 and cut_at is None:
                _ip("-n", NS_A, "link", "set", VETH_A, "down")
                cut_at = time.monotonic()
    assert cut_at is not None, events
    return events, time.monotonic() - cut_at
