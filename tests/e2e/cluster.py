"""Helpers for the reliability e2e tests: start P/D servers and proxies, check pools whole."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from tests.utils import Server, free_port, metric, start_server

MODEL = "SmolLM2-135M-Instruct"


def kv_config(policy: str = "recompute", **extra: Any) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                       "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": {"handshake_timeout": 2, **extra}})


def serve(kv: str | None = None, *args: str, **kw) -> Server:
    argv = ["serve", "--dtype", "float32", "--kv-cache-memory", "0.2", "--port",
            str(free_port()), *args]
    if kv:
        argv += ["--kv-transfer-config", kv, "--kv-side-channel-port", str(free_port())]
    return start_server(argv, **kw)


def proxy(prefill: Server, decode: Server, *args: str, **kw) -> Server:
    return start_server(["proxy", "--port", str(free_port()), "--prefill", prefill.url,
                         "--decode", decode.url, *args], **kw)


def remote_pd(prefill: str, decode: str, body: dict) -> httpx.Response:
    """What the proxy does, for /v1/completions: the prefill with do_remote_decode (one
    token), then the decode with the prefill's kv_transfer_params."""
    r = httpx.post(prefill + "/v1/completions", timeout=120, json={
        **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return httpx.post(decode + "/v1/completions", timeout=120, json={
        **body, "kv_transfer_params": r.json()["kv_transfer_params"]})


def stop(*servers: Server) -> None:
    for s in servers:
        s.stop()


def pools_whole(*urls: str, timeout: float = 10) -> float:
    """Wait until every server's KV pool is whole and nothing runs; returns the seconds it
    took (AssertionError naming the server otherwise)."""
    start = time.monotonic()
    for url in urls:
        while True:
            free, total = (metric(url, f"pdserve_kv_blocks_{k}") for k in ("free", "total"))
            running = metric(url, "pdserve_num_requests_running")
            held = metric(url, "pdserve_kv_blocks_held_for_remote")
            if free == total and running == held == 0:
                break
            assert time.monotonic() - start < timeout, (
                f"{url}: {free}/{total} KV blocks free, {running} running, {held} held for "
                f"remote after {timeout}s")
            time.sleep(0.1)
    return time.monotonic() - start


def healthy(*servers: Server) -> None:
    for s in servers:
        assert s.proc.poll() is None, f"{s.url} exited:\n{s.log()[-3000:]}"
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200
