"""Self-healing under `pdserve up --prefill 2 --decode 2` (real processes, real NIXL, float32):
an instance that dies is started again by up, counted in its metrics; the proxy retries a
prefill that dies under a request on the other one; a stream from a decode that dies ends
with an SSE error event; a decode handshakes afresh with a prefill that came back; and a
chaos run (an instance SIGKILLed every ~15 s under steady load) that loses nothing but
requests in flight on a killed decode, with every answer identical to monolithic.

The reference answers are plain requests straight to a decode instance, which computes
them itself (a monolith)."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import psutil
import pytest

from tests.e2e.cluster import MODEL, pools_whole, remote_pd
from tests.utils import PASSAGE, Server, free_port, metric, start_server

NAMES = ("prefill0", "prefill1", "decode0", "decode1")  # ports base + 0..3, as up lays out
PROMPTS = [f"Story {i}: " + PASSAGE[i * 40:i * 40 + 200] for i in range(8)]
LONG = "Long: " + PASSAGE * 5  # ~1400 tokens: its prefill takes a second or more here
CHAOS_SECONDS = 90
KILL_EVERY_S = 15


@dataclass(slots=True)
class Up:
    server: Server  # up itself; its url is the proxy's
    urls: dict[str, str]  # instance name -> its URL
    metrics: str  # up's own metrics endpoint

    def pid(self, name: str) -> int:
        port = self.urls[name].rsplit(":", 1)[1]
        for child in psutil.Process(self.server.proc.pid).children():
            cmd = child.cmdline()
            if "serve" in cmd and cmd[cmd.index("--port") + 1] == port:
                return child.pid
        raise AssertionError(f"{name} is not running")

    def kill(self, name: str) -> None:
        psutil.Process(self.pid(name)).kill()

    def restarts(self, name: str) -> float:
        return metric(self.metrics, "pdserve_up_restarts_total", instance=name)

    def wait_back(self, name: str, restarts: float, timeout: float = 120) -> None:
        """Until up has restarted `name` `restarts` times and it answers /health."""
        deadline = time.monotonic() + timeout
        while self.restarts(name) < restarts or not _healthy(self.urls[name]):
            assert time.monotonic() < deadline, f"{name} did not come back"
            time.sleep(0.5)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def up():
    port, base, side, mport = free_port(), free_port(count=4), free_port(count=4), free_port()
    server = start_server(
        ["up", "--prefill", "2", "--decode", "2", "--dtype", "float32", "--kv-cache-memory",
         "0.15", "--port", str(port), "--base-port", str(base), "--side-channel-base-port",
         str(side), "--metrics-port", str(mport), "--drain-timeout", "5"],
        url=f"http://127.0.0.1:{port}", timeout=300)
    yield Up(server, {n: f"http://127.0.0.1:{base + i}" for i, n in enumerate(NAMES)},
             f"http://127.0.0.1:{mport}")
    server.stop()


@pytest.fixture(scope="module")
def reference(up):
    return {p: _text(_complete(up.urls["decode1"], p)) for p in [*PROMPTS, LONG]}


def _complete(url: str, prompt: str, stream: bool = False, max_tokens: int = 16,
              timeout: float = 300) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=timeout, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": stream})


def _text(r: httpx.Response) -> str:
    """The text of a plain or streamed answer (AssertionError on any error)."""
    assert r.status_code == 200, r.text
    if not r.text.startswith("data:"):
        return r.json()["choices"][0]["text"]
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert not [e for e in events if "error" in e], r.text
    return "".join(c["text"] for e in events for c in e["choices"])


def test_a_killed_prefill_is_restarted_and_decodes_pull_from_it_again(up, reference,
                                                                       reliability_row):
    row = reliability_row("prefill SIGKILLed under `pdserve up`", "up --prefill 2 --decode 2; "
                          "prefill0 SIGKILLed; requests through the proxy meanwhile; then "
                          "P/D from the restarted prefill0 to decode0, which had pulled "
                          "from its old incarnation",
                          "requests keep succeeding (identical to monolithic); up restarts "
                          "prefill0 (counted); decode0 drops the stale NIXL peer and pulls "
                          "from the new one")
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    d0, p0 = up.urls["decode0"], up.urls["prefill0"]
    assert _text(remote_pd(p0, d0, body)) == reference[PROMPTS[0]]  # d0 knows p0's agent
    before = up.restarts("prefill0")
    up.kill("prefill0")
    for p in PROMPTS[1:4]:  # round robin sends some to the dead one: the proxy moves on
        assert _text(_complete(up.server.url, p)) == reference[p]
    up.wait_back("prefill0", before + 1)
    pulls = metric(d0, "pdserve_kv_transfers_total")
    recomputed = metric(d0, "pdserve_kv_transfer_recomputed_total")
    # The first may find decode0's peer stale (a failed READ: recomputed, the peer dropped);
    # the next handshakes afresh and pulls.
    for p in PROMPTS[4:6]:
        assert _text(remote_pd(p0, d0, {**body, "prompt": p})) == reference[p]
    assert metric(d0, "pdserve_kv_transfer_recomputed_total") - recomputed <= 1
    assert metric(d0, "pdserve_kv_transfers_total") - pulls >= 1
    pools_whole(*up.urls.values())
    row.observed(f"3/3 answered identically meanwhile; prefill0 restarted "
                 f"(pdserve_up_restarts_total {up.restarts('prefill0'):.0f}); decode0 "
                 f"recomputed {metric(d0, 'pdserve_kv_transfer_recomputed_total') - recomputed:.0f}"
                 f" then pulled {metric(d0, 'pdserve_kv_transfers_total') - pulls:.0f}; "
                 "pools whole")


def test_a_prefill_dying_under_a_request_is_retried_on_the_other(up, reference,
                                                                 reliability_row):
    row = reliability_row("prefill SIGKILLed while computing a prompt", "up --prefill 2 "
                          "--decode 2; a 1,400-token prompt through the proxy; the prefill "
                          "computing it SIGKILLed",
                          "the proxy sends it to the other prefill once; the answer is "
                          "identical to monolithic; the killed prefill comes back")
    restarts = {n: up.restarts(n) for n in NAMES[:2]}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_complete, up.server.url, LONG)
        deadline = time.monotonic() + 60
        while not (busy := [n for n in NAMES[:2]
                            if metric(up.urls[n], "pdserve_num_requests_running") > 0]):
            assert time.monotonic() < deadline, "no prefill took the prompt"
            time.sleep(0.05)
        up.kill(busy[0])
        got = answer.result()
    assert _text(got) == reference[LONG]
    log = up.server.log()
    assert f"prefill backend {up.urls[busy[0]]} lost the request" in log, log[-3000:]
    up.wait_back(busy[0], restarts[busy[0]] + 1)
    pools_whole(*up.urls.values())
    row.observed(f"{busy[0]} killed mid-prompt; the proxy logged it lost the request and "
                 "retried; answer identical to monolithic; it came back")


def test_a_stream_from_a_decode_that_dies_ends_with_an_error_event(up, reliability_row):
    row = reliability_row("decode SIGKILLed mid-stream", "up --prefill 2 --decode 2; a "
                          "400-token stream through the proxy; its decode SIGKILLed after a "
                          "few chunks", "the stream ends at once with an SSE error event "
                          "naming the decode, then [DONE]; up restarts the decode")
    restarts = {n: up.restarts(n) for n in NAMES[2:]}
    body = {"model": MODEL, "prompt": PROMPTS[6], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    lines: list[str] = []
    with httpx.stream("POST", up.server.url + "/v1/completions", json=body,
                      timeout=60) as r:
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 10:
                victim = next(n for n in NAMES[2:]
                              if metric(up.urls[n], "pdserve_num_requests_running") > 0)
                killed = time.monotonic()
                up.kill(victim)
        ended = time.monotonic() - killed
    events = [line for line in lines if line.startswith("data: ")]
    error = json.loads(events[-2][6:])["error"]
    assert events[-1] == "data: [DONE]" and error["code"] == 502, events[-3:]
    assert f"decode backend {up.urls[victim]} failed mid-stream" in error["message"]
    assert ended < 10
    up.wait_back(victim, restarts[victim] + 1)
    pools_whole(*up.urls.values())
    row.observed(f"the stream ended {ended:.1f}s after the kill with: {error['message']!r} "
                 f"and [DONE]; {victim} came back")


@dataclass(slots=True)
class Outcome:
    start: float
    end: float
    ok: bool
    cause: str


def test_chaos_instances_killed_under_load(up, reference, reliability_row):
    row = reliability_row(f"chaos: an instance SIGKILLed every ~{KILL_EVERY_S} s",
                          f"up --prefill 2 "
                          f"--decode 2 under {CHAOS_SECONDS} s of steady load (3 clients, "
                          "streaming and not, 16-token greedy completions of 8 prompts); "
                          f"a random prefill or decode SIGKILLed every ~{KILL_EVERY_S} s",
                          "every request not in flight on a killed decode succeeds, "
                          "identical to monolithic; every instance back and healthy; pools "
                          "whole; RSS bounded")
    rng = random.Random(26)
    kills: list[tuple[float, str]] = []
    outcomes: list[Outcome] = []
    stop = threading.Event()
    restarts = {n: up.restarts(n) for n in NAMES}

    def client(seed: int) -> None:
        crng = random.Random(seed)
        while not stop.is_set():
            prompt, stream = crng.choice(PROMPTS), crng.random() < 0.5
            start = time.monotonic()
            try:
                r = _complete(up.server.url, prompt, stream=stream, timeout=120)
                ok = _text(r) == reference[prompt]
                cause = "" if ok else f"output differs from monolithic: {_text(r)!r}"
            except AssertionError as e:
                ok, cause = False, str(e)[:300]
            except httpx.HTTPError as e:
                ok, cause = False, f"{type(e).__name__}: {e}"
            outcomes.append(Outcome(start, time.monotonic(), ok, cause))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    begin = time.monotonic()
    try:
        while time.monotonic() - begin < CHAOS_SECONDS - KILL_EVERY_S:
            time.sleep(KILL_EVERY_S * rng.uniform(0.75, 1.25))
            victim = rng.choice(NAMES)
            kills.append((time.monotonic(), victim))
            up.kill(victim)
        time.sleep(max(0.0, begin + CHAOS_SECONDS - time.monotonic()))
    finally:
        stop.set()
        for t in threads:
            t.join(180)
    for name in NAMES:
        up.wait_back(name, restarts[name] + sum(v == name for _, v in kills))
    pools_whole(*up.urls.values(), timeout=45)  # a killed decode's prefill: its lease (30 s)
    rss = {n: psutil.Process(up.pid(n)).memory_info().rss / 2**20 for n in NAMES}

    def on_killed_decode(o: Outcome) -> bool:
        return any(o.start <= t <= o.end and v.startswith("decode") for t, v in kills)

    failed = [o for o in outcomes if not o.ok]
    unexcused = [o.cause for o in failed if not on_killed_decode(o)]
    causes = "; ".join(sorted({o.cause[:160] for o in failed})) or "none"
    row.observed(f"{len(outcomes)} sent, {len(outcomes) - len(failed)} succeeded (identical "
                 f"to monolithic), {len(failed)} failed, {len(unexcused)} of them not on a "
                 f"killed decode; kills: {', '.join(v for _, v in kills)}; failure causes: "
                 f"{causes}; all back and healthy, pools whole; RSS "
                 f"{', '.join(f'{n} {v:.0f} MB' for n, v in rss.items())}")
    assert len(kills) >= 5 and len(outcomes) > 30
    assert not unexcused, unexcused
    assert max(rss.values()) < 4096, rss
