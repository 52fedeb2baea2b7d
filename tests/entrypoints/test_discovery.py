"""Discovery (`pdserve proxy --resolve-every`): pools follow what their names resolve to,
keeping the state of backends that stay. Bookkeeping with a resolver the test controls,
then a real proxy process resolving real names through its own /etc/hosts (a private
mount namespace) in front of tiny in-test backends on 127.0.0.2 and 127.0.0.3; the real
prefill/decode servers behind discovery are tests/e2e/test_kubernetes.py's."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer

import httpx
import pytest

from pdserve.entrypoints.discovery import Discovery, resolve
from pdserve.entrypoints.pd_flow import BackendDown, Proxy
from pdserve.entrypoints.routing import Pool, Residency
from tests.entrypoints.test_proxy_forwarding import _Backend
from tests.utils import free_port, metric, start_server


class _Names:
    """A resolver answering from a dict the test edits; OSError for names in `failing`."""

    def __init__(self, names: dict[str, list[str]]) -> None:
        self.names, self.failing = names, set()

    async def __call__(self, host: str, port: int) -> list[str]:
        if host in self.failing:
            raise OSError("temporary failure in name resolution")
        return self.names.get(host, [])


def _urls(pool: Pool) -> list[str]:
    return [b.url for b in pool.backends]


def test_pools_follow_their_names_and_keep_the_state_of_backends_that_stay():
    names = _Names({"decode": ["10.0.0.1", "10.0.0.2"]})
    pool = Pool("decode", [])
    found = Discovery([(pool, ["http://decode:8000", "http://10.9.9.9:8001"])], 1.0, names)
    asyncio.run(found.refresh())
    assert _urls(pool) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000",
                           "http://10.9.9.9:8001"]  # an IP address stays as given
    stays, leaves = pool.backends[1], pool.backends[0]
    stays.outstanding = 3
    stays.mark(reachable=False)
    residency = Residency()
    residency.sent(leaves, Residency.blocks(list(range(64))))
    names.names["decode"] = ["10.0.0.2", "10.0.0.3", "fd00::7"]  # one left, two joined
    asyncio.run(found.refresh())
    assert _urls(pool) == ["http://10.0.0.2:8000", "http://10.0.0.3:8000",
                           "http://10.9.9.9:8001", "http://[fd00::7]:8000"]
    assert pool.backends[0] is stays and stays.outstanding == 3 and not stays.up
    assert residency.find(Residency.blocks(list(range(64))), pool) == (None, 0)  # it left
    names.failing.add("decode")  # a resolver failing now keeps what was found last
    asyncio.run(found.refresh())
    assert len(pool.backends) == 4 and pool.backends[0] is stays
    names.failing.clear()
    names.names["decode"] = ["10.0.0.1"]  # a pod that comes back: a new backend
    asyncio.run(found.refresh())
    assert _urls(pool) == ["http://10.0.0.1:8000", "http://10.9.9.9:8001"]
    assert pool.backends[0] is not leaves


def test_prefix_homes_agree_across_proxies_that_found_backends_in_another_order():
    one, two = Pool("decode", [], "prefix"), Pool("decode", [], "prefix")
    one.update(["http://10.0.0.1:80", "http://10.0.0.2:80", "http://10.0.0.3:80"])
    two.update(["http://10.0.0.3:80", "http://10.0.0.1:80", "http://10.0.0.2:80"])
    keys = [str(i).encode() for i in range(30)]
    homes = [one.order(k)[0][0].url for k in keys]
    assert homes == [two.order(k)[0][0].url for k in keys]
    assert len(set(homes)) == 3


def test_an_empty_tier_is_a_clear_503_not_a_crash():
    pool = Pool("decode", [])
    assert pool.order(b"key") == ([], False)
    proxy = Proxy(Pool("prefill", []), pool, httpx.AsyncClient())
    with pytest.raises(BackendDown, match="no decode backend is known"):
        asyncio.run(proxy.post(pool, "/v1/completions", {}, "id", stream=False))


def test_the_system_resolver_answers_for_localhost():
    assert "127.0.0.1" in asyncio.run(resolve("localhost", 80))


# -- a real proxy process resolving names through a hosts file the test rewrites ----------

PREFILL, DECODE = "pdtest-prefill", "pdtest-decode"


@pytest.fixture(scope="module")
def hosts_file():
    """A hosts file, bind-mounted over /etc/hosts for one process only (a new mount
    namespace: the machine's own file is untouched)."""
    fd, path = tempfile.mkstemp(prefix="pdserve-hosts-")
    os.close(fd)
    probe = subprocess.run(["unshare", "--mount", "sh", "-c",
                            f"mount --bind {path} /etc/hosts"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /etc/hosts (needs CAP_SYS_ADMIN): {probe.stderr}")
    yield path
    os.unlink(path)


def _write_hosts(path: str, entries: list[tuple[str, str]]) -> None:
    with open(path, "w") as f:  # in place: the bind mount follows the inode, not the name
        f.write("".join(f"{addr} {name}\n" for addr, name in entries))


class _Served(_Backend):
    """A backend that also notes the address it was reached at."""
    at: list[tuple[str, dict]] = []  # (address, body)

    def do_POST(self):
        super().do_POST()
        # This request's own body: seen[-1] may already be the next leg's, sent to another
        # backend as soon as this one answered.
        self.at.append((self.server.server_address[0], self.body))


def _backend(addr: str, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((addr, port), _Served)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _await_backends(proxy: str, role: str, want: set[str]) -> None:
    """Wait until the proxy's pdserve_proxy_backend_up lists exactly `want` for `role`."""
    deadline = time.monotonic() + 30
    while (seen := _listed(proxy, role)) != want:
        assert time.monotonic() < deadline, f"{role} backends {seen}, expected {want}"
        time.sleep(0.1)


def _listed(proxy: str, role: str) -> set[str]:
    text = httpx.get(proxy + "/metrics", timeout=5).text
    return {line.split('backend="')[1].split('"')[0] for line in text.splitlines()
            if line.startswith("pdserve_proxy_backend_up{") and f'role="{role}"' in line}


def test_a_proxy_uses_backends_that_join_and_drops_those_that_leave(hosts_file):
    port = free_port()
    two, three = _backend("127.0.0.2", port), _backend("127.0.0.3", port)
    _write_hosts(hosts_file, [("127.0.0.2", PREFILL), ("127.0.0.2", DECODE)])
    private_hosts = ["unshare", "--mount", "sh", "-c",
                     'mount --bind "$0" /etc/hosts && exec "$@"', hosts_file]
    proxy = start_server(["proxy", "--resolve-every", "0.2",
                          "--prefill", f"http://{PREFILL}:{port}",
                          "--decode", f"http://{DECODE}:{port}/"], wrap=private_hosts)
    at = {a: f"http://{a}:{port}" for a in ("127.0.0.2", "127.0.0.3")}
    try:
        _await_backends(proxy.url, "decode", {at["127.0.0.2"]})
        _write_hosts(hosts_file, [("127.0.0.2", PREFILL), ("127.0.0.2", DECODE),
                                  ("127.0.0.3", DECODE)])
        _await_backends(proxy.url, "decode", set(at.values()))
        assert _decodes_used(proxy.url, 4) == {"127.0.0.2", "127.0.0.3"}  # round robin
        _write_hosts(hosts_file, [("127.0.0.2", PREFILL), ("127.0.0.3", DECODE)])
        _await_backends(proxy.url, "decode", {at["127.0.0.3"]})
        assert _decodes_used(proxy.url, 4) == {"127.0.0.3"}
        assert _listed(proxy.url, "prefill") == {at["127.0.0.2"]}
        _write_hosts(hosts_file, [("127.0.0.2", PREFILL)])  # no decode left: 503, say why
        _await_backends(proxy.url, "decode", set())
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "Hi"}, timeout=30)
        assert r.status_code == 503 and "no decode backend is known" in r.text
        assert httpx.get(proxy.url + "/health", timeout=5).status_code == 503
        assert metric(proxy.url, "pdserve_proxy_requests_total", outcome="ok") == 8
    finally:
        proxy.stop()
        two.shutdown()
        three.shutdown()


def _decodes_used(proxy: str, n: int) -> set[str]:
    """The addresses of the decodes that served `n` requests through the proxy."""
    _Served.at.clear()
    for _ in range(n):
        r = httpx.post(proxy + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, r.text
    return {addr for addr, body in _Served.at
            if not (body.get("kv_transfer_params") or {}).get("do_remote_decode")}
