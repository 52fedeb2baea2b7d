"""Data parallelism (seed 003): every rank its own engine id and side-channel port; the
DP matrix token-identical to monolithic, with every rank used; no leaks; port clashes
refused clearly."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.utils import free_port, metric, start_server, wait_for_metric

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [f"Question {i}: name a country whose name starts with the letter {c}." * (1 + i % 4)
           for i, c in enumerate("ABCDEFGHIJKL")]


def _serve(dp: int = 1, kv: bool = True) -> tuple:
    port, side = free_port(), free_port(count=dp)
    args = ["serve", "--dtype", "float32", "--kv-cache-memory", "0.2", "--port", str(port),
            "--data-parallel-size", str(dp)]
    if kv:
        args += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector",
                                                     "kv_role": "kv_both"}),
                 "--kv-side-channel-port", str(side)]
    return start_server(args, timeout=240)


@pytest.fixture(scope="module")
def servers():
    started = {}
    try:
        for name, dp, kv in (("mono", 1, False), ("p1", 1, True), ("p2", 2, True),
                             ("d2", 2, True)):
            started[name] = _serve(dp, kv)
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def reference(servers):
    return {p: _complete(servers["mono"].url, p) for p in PROMPTS}


def _complete(url: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _per_engine(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(rf'^{name}{{engine_id="([^"]+)"}} (\S+)$',
                                                   text, re.M)}


def test_ranks_have_distinct_engine_ids_and_ports(servers):
    ranks = [r for name in ("p1", "p2", "d2")
             for r in httpx.get(servers[name].url + "/v1/kv_transfer/info").json()["ranks"]]
    assert len(ranks) == 5
    assert len({r["engine_id"] for r in ranks}) == 5
    assert len({(r["side_channel_host"], r["side_channel_port"]) for r in ranks}) == 5
    p2 = httpx.get(servers["p2"].url + "/v1/kv_transfer/info").json()["ranks"]
    assert [r["dp_rank"] for r in p2] == [0, 1]
    assert p2[1]["side_channel_port"] == p2[0]["side_channel_port"] + 1
    assert p2[0]["engine_id"].endswith("_dp0") and p2[1]["engine_id"].endswith("_dp1")


@pytest.mark.parametrize("prefills", [["p1"], ["p2"], ["p1", "p2"]])
def test_dp_matrix_identical_and_every_rank_used(servers, reference, prefills):
    port = free_port()
    proxy = start_server(["proxy", "--port", str(port), "--decode", servers["d2"].url,
                          "--prefill", *[servers[p].url for p in prefills]])
    try:
        decode_before = _per_engine(servers["d2"].url, "pdserve_kv_transfers_total")
        prefill_before = {p: _per_engine(servers[p].url, "pdserve_prompt_tokens_computed_total")
                          for p in prefills}
        with ThreadPoolExecutor(8) as pool:
            got = dict(zip(PROMPTS, pool.map(lambda p: _complete(proxy.url, p), PROMPTS),
                           strict=True))
        assert got == reference
        decode_after = _per_engine(servers["d2"].url, "pdserve_kv_transfers_total")
        assert len(decode_after) == 2 and all(
            decode_after[e] > decode_before.get(e, 0) for e in decode_after), decode_after
        for p in prefills:
            after = _per_engine(servers[p].url, "pdserve_prompt_tokens_computed_total")
            assert all(after[e] > prefill_before[p].get(e, 0) for e in after), (p, after)
    finally:
        proxy.stop()
    for name in ("p1", "p2", "d2"):
        url = servers[name].url
        wait_for_metric(url, "pdserve_kv_blocks_free", metric(url, "pdserve_kv_blocks_total"))
        assert metric(url, "pdserve_kv_blocks_held_for_remote") == 0


def test_side_channel_port_in_use_is_refused_clearly():
    base = free_port(count=2)
    kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    with socket.socket() as taken:  # the second rank's port belongs to someone else
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        proc = subprocess.run(
            [sys.executable, "-m", "pdserve.entrypoints.cli", "serve", "--dtype", "float32",
             "--kv-cache-memory", "0.1", "--port", str(free_port()),
             "--data-parallel-size", "2", "--kv-transfer-config", kv,
             "--kv-side-channel-port", str(base)],
            capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert f"127.0.0.1:{base + 1}" in proc.stderr and "in use" in proc.stderr, \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_dead_rank_fails_its_requests_and_is_started_again(servers, reliability_row):
    # Runs last: it kills a rank of the DP2 decode server.
    row = reliability_row("DP rank SIGKILLed", "--data-parallel-size 2 server, a 400-token "
                          "request running on each rank, one rank's process SIGKILLed",
                          "its request fails with a message naming the rank, the other "
                          "completes; the server starts the rank again and serves on both "
                          "ranks, healthy, without a restart of its own")
    url = servers["d2"].url

    def ranks() -> list[psutil.Process]:
        return [p for p in psutil.Process(servers["d2"].proc.pid).children()
                if "spawn_main" in " ".join(p.cmdline())]

    before = ranks()
    assert len(before) == 2
    blocks = metric(url, "pdserve_kv_blocks_total")  # both ranks' (a live rank's count)

    def long_request() -> httpx.Response:
        return httpx.post(url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True,
            "temperature": 0})

    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(long_request) for _ in range(2)]  # one per rank
        wait_for_metric(url, "pdserve_num_requests_running", 2, timeout=60)
        before[0].kill()
        answers = [f.result() for f in running]
    codes = sorted(r.status_code for r in answers)
    assert codes == [200, 500], [r.text for r in answers]
    failed = next(r for r in answers if r.status_code == 500)
    assert "engine rank" in failed.json()["error"]["message"] and "died" in failed.text
    wait_for_metric(url, "pdserve_engine_rank_restarts_total", 1, timeout=30)
    deadline = time.monotonic() + 120
    while len(ranks()) < 2 or metric(url, "pdserve_kv_blocks_total") != blocks:
        assert time.monotonic() < deadline, "the rank did not come back"
        time.sleep(0.5)
    assert httpx.get(url + "/health").status_code == 200
    assert servers["d2"].proc.poll() is None and before[1].is_running()
    # Both ranks serve again: two at once go one to each, each identical to monolithic.
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda p: _complete(url, p), PROMPTS[1:3]))
    assert got == [_complete(servers["mono"].url, p) for p in PROMPTS[1:3]]
    row.observed(f"{failed.json()['error']['message']!r} for the killed rank's request; "
                 "the other completed; rank restarted (pdserve_engine_rank_restarts_total 1), "
                 "/health 200, both ranks answer identical to monolithic")
