"""Backpressure and time limits on a real server: --max-queue sheds a burst with 429s,
--request-timeout and a request's request_timeout abort with a 504, a client that leaves
a queued request (plain, streaming or prefill-role) frees it, and X-Request-Id is echoed and
names every log line about its request."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from tests.e2e.cluster import MODEL, healthy, kv_config, pools_whole, serve
from tests.utils import metric, wait_for_metric

MAX_SEQS, MAX_QUEUE, TIMEOUT = 2, 2, 20
SHORT = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6,
         "temperature": 0}
LONG = {**SHORT, "max_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    """kv_both, so it also takes prefill-role requests; 2 run, 2 wait, 20 s per request."""
    srv = serve(kv_config(kv_lease_duration=60), "--max-num-seqs", str(MAX_SEQS),
                "--max-queue", str(MAX_QUEUE), "--request-timeout", str(TIMEOUT))
    yield srv
    srv.stop()


def _post(url: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=kw.pop("timeout", 120), **kw)


@contextmanager
def _busy(url: str, n: int = MAX_SEQS):
    """n long streams hold the running slots (and the queue past MAX_SEQS) until the block
    ends (closing them aborts)."""
    stop = threading.Event()

    def hold() -> None:
        with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True},
                          timeout=120) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    wait_for_metric(url, "pdserve_requests_in_flight", n, timeout=60)
    wait_for_metric(url, "pdserve_num_requests_running", min(n, MAX_SEQS), timeout=60)
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(60)


def _rejected(url: str, reason: str) -> float:
    return metric(url, f'pdserve_requests_rejected_total{{reason="{reason}"}}')


def test_a_burst_past_the_queue_is_shed_with_429(server, reliability_row):
    row = reliability_row("load past capacity: a burst of 12 requests",
                          f"--max-num-seqs {MAX_SEQS} --max-queue {MAX_QUEUE}; 12 concurrent "
                          "requests (half streaming) at once",
                          "the first 4 admitted and answered; the rest 429 with a message "
                          "naming --max-queue, counted in pdserve_requests_rejected_total; "
                          "nothing hangs; server healthy, pool whole")
    before = _rejected(server.url, "queue_full")

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str]:
        body = {**SHORT, "stream": i % 2 == 1}
        r = await client.post(server.url + "/v1/completions", json=body)
        if r.status_code != 200:
            return r.status_code, r.json()["error"]["message"]
        if not body["stream"]:
            return 200, r.json()["choices"][0]["text"]
        events = [json.loads(x[6:]) for x in r.text.splitlines()
                  if x.startswith("data: {")]
        return 200, "".join(e["choices"][0]["text"] for e in events if e["choices"])

    async def burst() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[one(client, i) for i in range(12)])

    start = time.monotonic()
    results = asyncio.run(burst())
    took = time.monotonic() - start
    codes = [c for c, _ in results]
    ok = [text for c, text in results if c == 200]
    refused = [text for c, text in results if c == 429]
    assert len(ok) + len(refused) == 12, codes
    assert len(ok) >= MAX_SEQS + MAX_QUEUE and refused, codes
    assert len(set(ok)) == 1, ok  # greedy: one prompt, one answer, streamed or not
    assert all("--max-queue 2" in m and "retry" in m for m in refused), refused
    assert _rejected(server.url, "queue_full") - before == len(refused)
    healthy(server)
    pools_whole(server.url)
    row.observed(f"{len(ok)} answered (identical greedy text), {len(refused)} got 429 "
                 f"\"{refused[0]}\"; all 12 back in {took:.1f}s; pool whole")


@pytest.mark.parametrize("stream", [False, True])
def test_request_timeout_aborts_and_frees(server, stream, reliability_row):
    how = "streaming" if stream else "non-streaming"
    row = reliability_row(f"request_timeout ({how})", "a 1500-token request with "
                          "request_timeout 2 s", "504 (an SSE error event when streaming) "
                          "naming the limit; the request aborted, pool whole")
    before = metric(server.url, "pdserve_request_timeouts_total")
    body = {**LONG, "request_timeout": 2, "stream": stream}
    start = time.monotonic()
    r = _post(server.url, body)
    took = time.monotonic() - start
    if stream:
        assert r.status_code == 200
        events = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
    else:
        assert r.status_code == 504, r.text
        error = r.json()["error"]
    assert error["code"] == 504 and "timed out after 2s" in error["message"], error
    assert took >= 2
    assert metric(server.url, "pdserve_request_timeouts_total") == before + 1
    pools_whole(server.url)
    row.observed(f"{error['code']} after {took:.1f}s: {error['message']}; pool whole")


def test_server_request_timeout_flag(server, reliability_row):
    row = reliability_row("--request-timeout", f"server started with --request-timeout "
                          f"{TIMEOUT}; a 1500-token request without its own limit",
                          f"504 after {TIMEOUT} s; aborted, pool whole")
    start = time.monotonic()
    r = _post(server.url, LONG)
    took = time.monotonic() - start
    assert r.status_code == 504 and f"after {TIMEOUT}s" in r.json()["error"]["message"]
    assert took >= TIMEOUT
    pools_whole(server.url)
    row.observed(f"504 after {took:.1f}s; pool whole")


@pytest.mark.parametrize("role", ["plain", "streaming", "prefill-role"])
def test_client_leaving_a_queued_request_frees_it(server, role, reliability_row):
    row = reliability_row(f"client disconnect while queued ({role})",
                          f"{MAX_SEQS} long streams hold the running slots; a {role} request "
                          "waits in the queue; its client leaves after 1 s",
                          "the server aborts it at once (waiting 0, in flight back to 2); "
                          "once the slots free, pool whole and nothing held for remote")
    body = dict(SHORT)
    if role == "prefill-role":
        body.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    with _busy(server.url):
        wait_for_metric(server.url, "pdserve_requests_in_flight", MAX_SEQS)
        if role == "streaming":
            with httpx.stream("POST", server.url + "/v1/completions",
                              json={**body, "stream": True}, timeout=60) as r:
                assert r.status_code == 200
                wait_for_metric(server.url, "pdserve_num_requests_waiting", 1)
        else:
            with pytest.raises(httpx.ReadTimeout):
                _post(server.url, body, timeout=1)
        wait_for_metric(server.url, "pdserve_num_requests_waiting", 0, timeout=20)
        wait_for_metric(server.url, "pdserve_requests_in_flight", MAX_SEQS, timeout=20)
    took = pools_whole(server.url, timeout=30)
    assert metric(server.url, "pdserve_kv_blocks_held_for_remote") == 0
    healthy(server)
    row.observed(f"aborted while queued; pool whole {took:.1f}s after the slots freed, "
                 "0 held for remote")


def test_a_refused_decode_lets_its_prefill_go(server, reliability_row):
    row = reliability_row("decode full: a decode-role request refused (429)",
                          "this server prefills (lease 60 s), then, full, refuses the decode "
                          "half with 429", "429; the decode tells the prefill at once, which "
                          "frees its blocks long before the lease ends")
    params = _post(server.url, {**SHORT, "max_tokens": 1, "kv_transfer_params":
                                {"do_remote_decode": True}}).json()["kv_transfer_params"]
    assert metric(server.url, "pdserve_kv_blocks_held_for_remote") > 0
    with _busy(server.url, MAX_SEQS + MAX_QUEUE):
        r = _post(server.url, {**SHORT, "kv_transfer_params": params})
        assert r.status_code == 429, r.text
        start = time.monotonic()
        wait_for_metric(server.url, "pdserve_kv_blocks_held_for_remote", 0, timeout=20)
        took = time.monotonic() - start
    assert metric(server.url, "pdserve_kv_lease_expired_total") == 0
    pools_whole(server.url, timeout=30)
    row.observed(f"429; the prefill's blocks freed {took:.1f}s later (lease 60 s), "
                 "no lease expired")


def test_request_id_is_echoed_and_names_every_log_line(server):
    rid = "ops-test-7f3a91"
    r = _post(server.url, {**SHORT, "max_tokens": 1, "kv_transfer_params":
                           {"do_remote_decode": True}}, headers={"X-Request-Id": rid})
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    params = r.json()["kv_transfer_params"]
    assert params["remote_request_id"].startswith(rid)
    r = _post(server.url, {**SHORT, "kv_transfer_params": params},  # the decode side
              headers={"X-Request-Id": rid})
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    bad = _post(server.url, {**SHORT, "max_tokens": 0}, headers={"X-Request-Id": rid + "b"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == rid + "b"
    made = _post(server.url, SHORT).headers["x-request-id"]  # none given: one is made up
    assert len(made) == 32
    for odd in ("with space", "x" * 257, "é".encode()):  # it goes into logs and headers
        r = _post(server.url, SHORT, headers={"X-Request-Id": odd})
        assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"]
        assert len(r.headers["x-request-id"]) == 32
    pools_whole(server.url)
    lines = [x for x in server.log().splitlines() if rid in x]
    assert any("prefill for a remote decode" in x for x in lines), lines
    assert any("decode of a remote prefill" in x for x in lines), lines
    assert sum("finished (" in x for x in lines) == 2, lines
    assert all(f"request {rid}-" in x for x in lines), lines  # one format for them all
    assert any(f"request {made}-" in x and "finished" in x for x in server.log().splitlines())
