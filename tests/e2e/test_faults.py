"""Faults injected for real: a prefill killed between its answer and the pull, a prefill
restarted on the same ports, backends down behind the proxy."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.utils import free_port, metric, start_server, wait_for_metric

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The committee met on Tuesday to discuss the new budget for the library. " * 5


def _kv(policy: str = "recompute") -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                       "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": {"handshake_timeout": 2}})


def _serve(kv: str | None, port: int | None = None, side: int | None = None, **kw):
    args = ["serve", "--dtype", "float32", "--kv-cache-memory", "0.2",
            "--port", str(port or free_port())]
    if kv:
        args += ["--kv-transfer-config", kv, "--kv-side-channel-port", str(side or free_port())]
    return start_server(args, **kw)


@pytest.fixture(scope="module")
def mono():
    server = _serve(None)
    yield server
    server.stop()


def _body(**kw) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, **kw}


def _prefill(url: str) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60, json=_body(
        max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_killed_before_the_pull(mono, policy):
    prefill = _serve(_kv())
    decode = None
    try:
        decode = _serve(_kv(policy))
        params = _prefill(prefill.url)
        os.killpg(prefill.proc.pid, signal.SIGKILL)
        prefill.proc.wait()
        start = time.monotonic()
        r = httpx.post(decode.url + "/v1/completions", json=_body(kv_transfer_params=params),
                       timeout=60)
        assert time.monotonic() - start < 30  # bounded by the handshake timeout
        if policy == "recompute":
            want = httpx.post(mono.url + "/v1/completions", json=_body(), timeout=60).json()
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
            assert metric(decode.url, "pdserve_kv_transfer_recomputed_total") == 1
        else:
            assert r.status_code >= 500 and "handshake" in r.json()["error"]["message"]
        assert metric(decode.url, "pdserve_kv_transfer_failures_total") == 1
        wait_for_metric(decode.url, "pdserve_kv_blocks_free",
                        metric(decode.url, "pdserve_kv_blocks_total"))
    finally:
        prefill.stop()
        if decode is not None:
            decode.stop()


def test_restarted_prefill_gets_a_fresh_handshake(mono):
    port, side = free_port(), free_port()
    decode = _serve(_kv())
    want = httpx.post(mono.url + "/v1/completions", json=_body(), timeout=60).json()
    try:
        for _ in range(2):  # the second prefill reuses the ports, with a new engine and agent
            prefill = _serve(_kv(), port=port, side=side)
            try:
                params = _prefill(prefill.url)
                r = httpx.post(decode.url + "/v1/completions", timeout=60,
                               json=_body(kv_transfer_params=params))
                assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
                wait_for_metric(prefill.url, "pdserve_kv_blocks_held_for_remote", 0)
            finally:
                prefill.stop()
        assert metric(decode.url, "pdserve_kv_transfers_total") == 2
        assert metric(decode.url, "pdserve_kv_transfer_failures_total") == 0
    finally:
        decode.stop()


def test_proxy_skips_a_down_backend_and_names_them_when_all_are_down(mono):
    """A dead prefill is skipped; with none, the decode prefills; with no decode, a 503."""
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = start_server(["proxy", "--port", str(free_port()), "--prefill", dead, mono.url,
                          "--decode", mono.url])
    try:
        for _ in range(3):  # round robin lands on the dead prefill too: it is skipped
            r = httpx.post(proxy.url + "/v1/completions", json=_body(max_tokens=2), timeout=60)
            assert r.status_code == 200, r.text
        assert httpx.get(proxy.url + "/health").json()["backends"][dead] == "down"
    finally:
        proxy.stop()
    # No prefill up: the decode prefills the prompt itself.
    proxy = start_server(["proxy", "--port", str(free_port()), "--prefill", dead,
                          "--decode", mono.url], health="/v1/models")
    try:
        r = httpx.post(proxy.url + "/v1/completions", json=_body(max_tokens=2), timeout=60)
        assert r.status_code == 200, r.text
        assert metric(proxy.url, "pdserve_proxy_routes_total", route="local",
                      reason="prefill_down") == 1
    finally:
        proxy.stop()
    # Nothing up: a 503 naming what was tried.
    dead_decode = f"http://127.0.0.1:{free_port()}"
    proxy = start_server(["proxy", "--port", str(free_port()), "--prefill", dead,
                          "--decode", dead_decode], health="/metrics")
    try:
        r = httpx.post(proxy.url + "/v1/completions", json=_body(max_tokens=2), timeout=60)
        assert r.status_code == 503 and dead_decode in r.json()["error"]["message"], r.text
        bad = httpx.post(proxy.url + "/v1/completions", content=b"{not json", timeout=10)
        assert bad.status_code == 400
    finally:
        proxy.stop()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_killed_in_the_middle_of_the_pull(mono, policy, reliability_row):
    row = reliability_row(f"prefill SIGKILLed mid-pull ({policy})",
                          "decode handshaken and about to READ (held 3 s by "
                          "PDSERVE_FAULT_TRANSFER_DELAY_S), prefill SIGKILLed in that window",
                          "recompute: output token-identical to monolithic; fail: a clear "
                          "5xx; either way within transfer_timeout, decode pool whole")
    prefill = _serve(_kv())
    decode = None
    try:
        kv = json.dumps({**json.loads(_kv(policy)), "kv_connector_extra_config": {
            "handshake_timeout": 2, "transfer_timeout": 5}})
        decode = _serve(kv, env={"PDSERVE_FAULT_TRANSFER_DELAY_S": "3"})
        params = _prefill(prefill.url)
        result: list[httpx.Response] = []
        pull = threading.Thread(target=lambda: result.append(httpx.post(
            decode.url + "/v1/completions", json=_body(kv_transfer_params=params),
            timeout=120)))
        start = time.monotonic()
        pull.start()
        deadline = start + 60
        while "holding its KV READ" not in decode.log():
            assert time.monotonic() < deadline, decode.log()[-2000:]
            time.sleep(0.05)
        os.killpg(prefill.proc.pid, signal.SIGKILL)
        prefill.proc.wait()
        pull.join(120)
        took = time.monotonic() - start
        r = result[0]
        assert took < 60  # handshake + the 3 s hold + transfer_timeout, with room to spare
        if policy == "recompute":
            want = httpx.post(mono.url + "/v1/completions", json=_body(), timeout=60).json()
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
            outcome = "200, text identical to monolithic"
        else:
            message = r.json()["error"]["message"]
            assert r.status_code >= 500 and "KV read" in message, r.text
            outcome = f"{r.status_code}: {message.replace(str(params['remote_port']), 'PORT')}"
        assert metric(decode.url, "pdserve_kv_transfer_failures_total") == 1
        assert metric(decode.url, "pdserve_kv_transfers_total") == 0
        wait_for_metric(decode.url, "pdserve_kv_blocks_free",
                        metric(decode.url, "pdserve_kv_blocks_total"))
        assert httpx.get(decode.url + "/health", timeout=10).status_code == 200
    finally:
        prefill.stop()
        if decode is not None:
            decode.stop()
    row.observed(f"{outcome}; the request ended {took:.1f}s after it was sent; decode pool "
                 "whole, healthy")
