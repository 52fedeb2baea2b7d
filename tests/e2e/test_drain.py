"""Graceful drain on SIGTERM, on real processes: running requests finish (or are aborted
with a clear error past --drain-timeout), new ones get 503, /health says draining, blocks
held for remote decodes are read or freed, and the process exits 0. Also DP servers and
`pdserve up`."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.cluster import MODEL, kv_config, pools_whole, serve
from tests.utils import Server, free_port, metric, start_server, wait_for_metric

BODY = {"model": MODEL, "prompt": "The lighthouse keeper climbed the stairs", "max_tokens": 24,
        "temperature": 0, "ignore_eos": True}
LONG = {**BODY, "max_tokens": 1500}


def _term(server: Server) -> None:
    os.kill(server.proc.pid, signal.SIGTERM)  # the server only: it stops its own ranks


def _exit_code(server: Server, timeout: float = 60) -> int:
    return server.proc.wait(timeout)


def _stream(url: str, body: dict, first: threading.Event | None = None) -> list[dict]:
    """A streamed completion's events (first is set once the first chunk arrived)."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if first is not None:
                    first.set()
    return events


def _text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def _assert_refuses_while_draining(url: str) -> str:
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    r = httpx.post(url + "/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert "shutting down" in message
    return message


def _wait_draining(url: str) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(url + "/health", timeout=10).status_code != 503:
        assert time.monotonic() < deadline, "the server did not start draining"
        time.sleep(0.1)


def test_sigterm_finishes_running_streams_refuses_new_and_exits_0(reliability_row):
    row = reliability_row("SIGTERM with a stream running", "a 24-token stream in flight, "
                          "then SIGTERM (--drain-timeout 120)",
                          "the stream completes in full; new requests 503 with a message; "
                          "/health 503 draining; exit 0")
    server = serve(None, "--drain-timeout", "120")
    try:
        want = httpx.post(server.url + "/v1/completions", json=BODY, timeout=60).json()
        first = threading.Event()
        t, out = _in_thread(_stream, server.url, BODY, first)
        assert first.wait(60)
        _term(server)
        _wait_draining(server.url)
        message = _assert_refuses_while_draining(server.url)
        assert metric(server.url, 'pdserve_requests_rejected_total{reason="draining"}') == 1
        t.join(120)
        assert _text(out[0]) == want["choices"][0]["text"]
        assert out[0][-1]["choices"][0]["finish_reason"] == "length"
        assert _exit_code(server) == 0
    finally:
        server.stop()
    assert "drained; exiting" in server.log()
    row.observed(f"the stream finished all 24 tokens (text identical to before); new "
                 f"request: 503 \"{message}\"; exit status 0")


def test_drain_timeout_aborts_with_a_clear_error(reliability_row):
    row = reliability_row("SIGTERM past --drain-timeout", "a 1500-token stream and a "
                          "1500-token plain request in flight, SIGTERM with --drain-timeout 2",
                          "both aborted after 2 s with a 503 saying the server is shutting "
                          "down (an SSE error event for the stream); exit 0")
    server = serve(None, "--drain-timeout", "2")
    try:
        first = threading.Event()
        streamed, s_out = _in_thread(_stream, server.url, LONG, first)
        plain, p_out = _in_thread(lambda: httpx.post(server.url + "/v1/completions",
                                                     json=LONG, timeout=120))
        assert first.wait(60)
        wait_for_metric(server.url, "pdserve_num_requests_running", 2, timeout=60)
        start = time.monotonic()
        _term(server)
        streamed.join(60)
        plain.join(60)
        assert _exit_code(server) == 0
        took = time.monotonic() - start
    finally:
        server.stop()
    error = s_out[0][-1]["error"]
    assert error["code"] == 503 and "shutting down" in error["message"], error
    assert p_out[0].status_code == 503 and "shutting down" in p_out[0].json()["error"]["message"]
    assert "aborting 2 requests" in server.log()
    row.observed(f"both 503: \"{error['message']}\"; exited 0 {took:.1f}s after SIGTERM")


@pytest.fixture(scope="module")
def decode():
    srv = serve(kv_config())
    yield srv
    srv.stop()


def _prefill_for_remote(url: str) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        **BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_draining_prefill_waits_for_the_decode_to_read_its_blocks(decode, reliability_row):
    row = reliability_row("SIGTERM on a prefill holding blocks for a decode",
                          "prefill answered (blocks held, lease 300 s), SIGTERM (drain 120 s), "
                          "then the decode pulls", "the side channel still serves during the "
                          "drain: the pull succeeds, output = monolithic; the prefill exits 0 "
                          "once the blocks are read, without waiting out the drain")
    prefill = serve(kv_config(kv_lease_duration=300), "--drain-timeout", "120")
    try:
        params = _prefill_for_remote(prefill.url)
        assert metric(prefill.url, "pdserve_kv_blocks_held_for_remote") > 0
        _term(prefill)
        _wait_draining(prefill.url)
        start = time.monotonic()
        assert metric(prefill.url, "pdserve_kv_blocks_held_for_remote") > 0  # still waiting
        transfers = metric(decode.url, "pdserve_kv_transfers_total")
        r = httpx.post(decode.url + "/v1/completions", timeout=60,
                       json={**BODY, "kv_transfer_params": params})
        assert metric(decode.url, "pdserve_kv_transfers_total") == transfers + 1
        assert _exit_code(prefill, 60) == 0
        took = time.monotonic() - start
    finally:
        prefill.stop()
    want = httpx.post(decode.url + "/v1/completions", json=BODY, timeout=60).json()
    assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
    assert "aborting" not in prefill.log() and "expired" not in prefill.log()
    pools_whole(decode.url)
    row.observed(f"pulled during the drain, output identical; prefill exited 0 {took:.1f}s "
                 "after the pull began (drain limit 120 s)")


def test_draining_prefill_frees_unread_blocks_and_exits(reliability_row):
    row = reliability_row("SIGTERM on a prefill whose decode never comes",
                          "prefill answered (blocks held, lease 300 s), SIGTERM with "
                          "--drain-timeout 2", "after 2 s the leases end, the blocks are "
                          "freed (logged, counted as expired), exit 0")
    prefill = serve(kv_config(kv_lease_duration=300), "--drain-timeout", "2")
    try:
        params = _prefill_for_remote(prefill.url)
        held = metric(prefill.url, "pdserve_kv_blocks_held_for_remote")
        assert held == len(params["remote_block_ids"])
        _term(prefill)
        assert _exit_code(prefill) == 0
    finally:
        prefill.stop()
    lines = [x for x in prefill.log().splitlines() if "expired" in x]
    assert len(lines) == 1 and params["remote_request_id"] in lines[0], lines
    row.observed(f"{lines[0].split(': ', 1)[1]}; exit 0")


def test_dp_server_sheds_and_drains(reliability_row):
    row = reliability_row("DP=2 server: a burst, then SIGTERM", "--data-parallel-size 2 "
                          "--max-num-seqs 1 --max-queue 0; 2 long streams, a third request, "
                          "SIGTERM (--drain-timeout 2)", "the third gets 429; on SIGTERM new "
                          "requests 503, the streams end with a 503 error; exit 0")
    server = serve(None, "--data-parallel-size", "2", "--max-num-seqs", "1", "--max-queue",
                   "0", "--drain-timeout", "2", timeout=300)
    try:
        first = [threading.Event(), threading.Event()]
        threads = [_in_thread(_stream, server.url, LONG, e) for e in first]
        assert all(e.wait(60) for e in first)
        r = httpx.post(server.url + "/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 429 and "--max-queue 0" in r.json()["error"]["message"]
        _term(server)
        _wait_draining(server.url)
        _assert_refuses_while_draining(server.url)
        for t, _ in threads:
            t.join(60)
        assert _exit_code(server) == 0
    finally:
        server.stop()
    errors = [out[0][-1]["error"]["code"] for _, out in threads]
    assert errors == [503, 503]
    row.observed("429 past the queue; 503 while draining; both streams ended with a 503 "
                 "error event; exit 0")


def test_pdserve_up_forwards_sigterm_and_lets_streams_finish(reliability_row):
    row = reliability_row("SIGTERM to `pdserve up`", "1P1D via `pdserve up`, a 24-token "
                          "stream through the proxy in flight, SIGTERM to up",
                          "up forwards SIGTERM; the stream completes; every child gone; "
                          "up exits 0")
    port, base, side = free_port(), free_port(count=2), free_port(count=2)
    up = start_server(["up", "--dtype", "float32", "--kv-cache-memory", "0.2", "--port",
                       str(port), "--base-port", str(base), "--side-channel-base-port",
                       str(side), "--drain-timeout", "60"], url=f"http://127.0.0.1:{port}",
                      timeout=300)
    try:
        pids = _children(up.proc.pid)
        first = threading.Event()
        t, out = _in_thread(_stream, up.url, BODY, first)
        assert first.wait(60)
        os.kill(up.proc.pid, signal.SIGTERM)
        t.join(120)
        assert _exit_code(up, 90) == 0
    finally:
        up.stop()
    assert len(_text(out[0])) > 0 and out[0][-1]["choices"][0]["finish_reason"] == "length"
    assert not [p for p in pids if _alive(p)]
    row.observed(f"the stream finished (24 tokens); {len(pids)} children exited; up exit 0")


def _children(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
