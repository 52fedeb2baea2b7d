"""The proxy's routing on real processes: two prefill and two decode servers (real NIXL,
float32) behind three proxies. Its /metrics and request ids; conditional disaggregation by
prompt length and by prefill queue, token-identical to a monolithic answer either way;
prefix-aware routing keeps a shared prefix on one prefill/decode pair, spreads others and
leaves a busy home.

The monolithic reference is a plain request (no kv_transfer_params) sent straight to the
decode the proxies do not use, D1 for the conditional proxy: a `pdserve serve` that
computes the whole request itself."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.cluster import MODEL, kv_config, pools_whole, serve, stop
from tests.utils import PASSAGE, free_port, metric, start_server

SHORT = "The capital of France is"
LONG = PASSAGE * 5  # ~1400 tokens: its prefill takes seconds on this host
CHAT = [{"role": "user", "content": "Name a colour."}]  # ~35 tokens with the template
LOCAL_BELOW = 24


@pytest.fixture(scope="module")
def cluster():
    with ThreadPoolExecutor(4) as pool:
        servers = list(pool.map(lambda _: serve(kv_config()), range(4)))
    p0, p1, d0, d1 = servers
    dead = f"http://127.0.0.1:{free_port()}"

    def proxy(prefill: list[str], decode: list[str], *args: str, health: str = "/health"):
        return start_server(["proxy", "--port", str(free_port()), "--prefill", *prefill,
                             "--decode", *decode, *args], health=health)

    proxies = {
        "plain": proxy([dead, p0.url], [d0.url]),  # round robin: the dead one first
        "cond": proxy([p0.url], [d0.url], "--local-prefill-below", str(LOCAL_BELOW),
                      "--max-prefill-queue", "0"),
        "overflow": proxy([dead], [d0.url], "--max-prefill-queue", "4",  # no prefill up,
                          health="/v1/models"),  # so its /health says 503
        "prefix": proxy([p0.url, p1.url], [d0.url, d1.url], "--policy", "prefix",
                        "--prefix-max-imbalance", "0"),  # leave home when it is busier
        "turns": proxy([p1.url], [d0.url, d1.url], "--local-prefill-below", "96"),
    }
    yield {"p0": p0.url, "p1": p1.url, "d0": d0.url, "d1": d1.url, "dead": dead,
           "servers": dict(zip(("p0", "p1", "d0", "d1"), servers, strict=True)), **proxies}
    stop(*proxies.values(), *servers)


def _complete(url: str, prompt, max_tokens: int = 12, stream: bool = False,
              headers: dict | None = None) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, "logprobs": 0}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=300)


def _tokens(r: httpx.Response) -> list[str]:
    """Generated token strings of a plain or streamed completion."""
    assert r.status_code == 200, r.text
    if not r.text.startswith("data:"):
        return r.json()["choices"][0]["logprobs"]["tokens"]
    return [t for line in r.text.splitlines() if line.startswith("data: {")
            for c in json.loads(line[6:])["choices"] for t in c["logprobs"]["tokens"]]


def _route(proxy: str, route: str, reason: str) -> float:
    return metric(proxy, "pdserve_proxy_routes_total", route=route, reason=reason)


def test_metrics_request_id_and_retries(cluster):
    plain, p0, d0, dead = cluster["plain"].url, cluster["p0"], cluster["d0"], cluster["dead"]
    r = _complete(plain, SHORT, headers={"X-Request-Id": "rid-e2e-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "rid-e2e-1"
    assert r.json()["id"].startswith("cmpl-rid-e2e-1-")  # the decode ran it under that id
    s = _complete(plain, SHORT, stream=True)
    generated = s.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated) and _tokens(s) == _tokens(r)
    bad = httpx.post(plain + "/v1/completions", content=b"{nope", timeout=30)
    wrong = httpx.post(plain + "/v1/completions", json={"model": "gpt-9", "prompt": "x"},
                       timeout=30)
    assert (bad.status_code, wrong.status_code) == (400, 404) and bad.headers["x-request-id"]

    ok = metric(plain, "pdserve_proxy_requests_total", endpoint="/v1/completions",
                outcome="ok")
    errors = metric(plain, "pdserve_proxy_requests_total", outcome="client_error")
    assert (ok, errors) == (2, 2)
    # Round robin put the dead prefill first, the proxy moved on and counted each attempt
    # (after one it is tried last for a while, so later requests may not try it at all).
    retries = metric(plain, "pdserve_proxy_retries_total", backend=dead, role="prefill")
    log = cluster["plain"].log()
    assert retries == log.count(f"prefill backend {dead} unreachable") >= 1
    assert metric(plain, "pdserve_proxy_backend_request_seconds_count", backend=p0,
                  role="prefill") == 3  # the two answers and the wrong model's 404
    assert metric(plain, "pdserve_proxy_backend_request_seconds_count", backend=d0,
                  role="decode") == 2
    assert metric(plain, "pdserve_proxy_backend_requests_total", backend=p0, role="prefill",
                  code="404") == 1
    assert _route(plain, "remote", "disaggregated") == 3
    assert metric(plain, "pdserve_proxy_backend_outstanding") == 0

    mine = [line for line in log.splitlines() if "rid-e2e-1" in line]
    assert any("unreachable" in line for line in mine), log[-2000:]
    assert any(f"prefill {p0} -> decode {d0} answered 200" in line for line in mine)
    assert all("request rid-e2e-1: " in line for line in mine)
    assert f"request {generated}: " in log
    # The prefill and the decode log it under the same id, with a suffix of their own.
    for name in ("p0", "d0"):
        server_log = cluster["servers"][name].log()
        assert re.search(r"request rid-e2e-1-[0-9a-f]{8}: \d+ prompt tokens", server_log), \
            (name, server_log[-2000:])


def test_short_prompts_prefill_on_the_decode(cluster):
    cond, p0, d0, ref = cluster["cond"].url, cluster["p0"], cluster["d0"], cluster["d1"]
    prefill_before = metric(p0, "pdserve_prompt_tokens_total")
    computed_before = metric(d0, "pdserve_prompt_tokens_computed_total")
    local_before = _route(cond, "local", "short_prompt")
    want = _complete(ref, SHORT)
    n_short = want.json()["usage"]["prompt_tokens"]
    assert n_short < LOCAL_BELOW
    for stream in (False, True):
        assert _tokens(_complete(cond, SHORT, stream=stream)) == _tokens(want)
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    want_chat = httpx.post(ref + "/v1/chat/completions", json=chat, timeout=300).json()
    got = httpx.post(cond + "/v1/chat/completions", json=chat, timeout=300).json()
    assert got["choices"][0]["message"] == want_chat["choices"][0]["message"]
    n_chat = got["usage"]["prompt_tokens"]
    assert n_chat >= LOCAL_BELOW  # so the chat went through the prefill
    assert _route(cond, "local", "short_prompt") - local_before == 2
    # The short prompts never reached the prefill; the decode computed them itself.
    assert metric(p0, "pdserve_prompt_tokens_total") - prefill_before == n_chat
    assert metric(d0, "pdserve_prompt_tokens_computed_total") - computed_before == 2 * n_short
    pools_whole(p0, d0)


def test_busy_prefill_tier_sends_new_requests_to_the_decode(cluster):
    cond, p0, d0, ref = cluster["cond"].url, cluster["p0"], cluster["d0"], cluster["d1"]
    # Over --local-prefill-below, and each new to the decode (whose copy of a prompt it
    # prefilled would make it a cached_prefix, not a disaggregated, route).
    mids = [f"Case {i}. " + PASSAGE[:300] for i in range(3)]
    wants = [_tokens(_complete(ref, mid)) for mid in mids]
    busy_before = _route(cond, "local", "prefill_busy")
    with ThreadPoolExecutor(2) as pool:
        # The proxy's own count: its long prompt is still on the prefill. (Long prompts
        # here are new to the prefix cache, or the prefill would skip their work.)
        long = pool.submit(_complete, cond, "Busy: " + LONG, 2)
        _wait(lambda: metric(cond, "pdserve_proxy_backend_outstanding", role="prefill") == 1)
        assert _tokens(_complete(cond, mids[0])) == wants[0]
        assert long.result().status_code == 200
        assert _route(cond, "local", "prefill_busy") - busy_before == 1
        # The prefill's own queue (polled from its /metrics): clients the proxy never saw.
        direct = [pool.submit(_complete, p0, f"Direct {i}: " + LONG, 1) for i in range(2)]
        _wait(lambda: metric(cond, "pdserve_proxy_backend_queue", role="prefill") >= 1)
        assert metric(cond, "pdserve_proxy_backend_outstanding", role="prefill") == 0
        assert _tokens(_complete(cond, mids[1])) == wants[1]
        assert all(f.result().status_code == 200 for f in direct)
    assert _route(cond, "local", "prefill_busy") - busy_before == 2
    # Idle again: such a prompt is disaggregated.
    _wait(lambda: metric(cond, "pdserve_proxy_backend_queue", role="prefill") == 0)
    remote_before = _route(cond, "remote", "disaggregated")
    assert _tokens(_complete(cond, mids[2])) == wants[2]
    assert _route(cond, "remote", "disaggregated") - remote_before == 1
    pools_whole(p0, d0)


def test_overflow_waits_while_the_decode_prefills_one_of_its_own(cluster):
    """--max-prefill-queue 0 with one prompt on the prefill and one the decode is
    prefilling itself: the next is not > 0 + 1 deep, so it is disaggregated, not piled
    onto the decode."""
    cond, p0, d0, ref = cluster["cond"].url, cluster["p0"], cluster["d0"], cluster["d1"]
    mid = PASSAGE[:300]
    want = _tokens(_complete(ref, mid))
    remote_before = _route(cond, "remote", "disaggregated")
    busy_before = _route(cond, "local", "prefill_busy")
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(_complete, cond, "Held: " + LONG, 2)
        _wait(lambda: metric(cond, "pdserve_proxy_backend_outstanding", role="prefill") == 1)
        local = pool.submit(_complete, cond, "Local: " + LONG, 2)
        _wait(lambda: metric(cond, "pdserve_proxy_backend_local_prefills", role="decode") == 1)
        assert _route(cond, "local", "prefill_busy") - busy_before == 1
        assert _tokens(_complete(cond, mid)) == want
        assert _route(cond, "remote", "disaggregated") - remote_before == 2  # held and mid
        assert held.result().status_code == 200 and local.result().status_code == 200
    assert metric(cond, "pdserve_proxy_backend_local_prefills", role="decode") == 0
    pools_whole(p0, d0)


def test_with_no_prefill_reachable_the_decode_serves_alone(cluster):
    overflow, d0, ref, dead = (cluster["overflow"].url, cluster["d0"], cluster["d1"],
                               cluster["dead"])
    want = _tokens(_complete(ref, SHORT))
    for stream in (False, True):  # the first finds the prefill down, the next knows it
        assert _tokens(_complete(overflow, SHORT, stream=stream)) == want
    assert _route(overflow, "local", "prefill_down") == 2
    assert metric(overflow, "pdserve_proxy_retries_total", backend=dead) >= 1
    pools_whole(d0)


def test_prefix_policy_keeps_a_prefix_on_one_pair_and_spreads_others(cluster):
    proxy = cluster["prefix"].url
    prefill, decode = (cluster["p0"], cluster["p1"]), (cluster["d0"], cluster["d1"])

    def counts() -> list[float]:
        return [metric(proxy, "pdserve_proxy_backend_requests_total", backend=b)
                for b in (*prefill, *decode)]

    shared = "Case file 7. " + PASSAGE[:400]  # well over --prefix-tokens (64)
    before = counts()
    for tail in ("Who climbed the stairs?", "What is glucose?", "When did Apollo 11 land?"):
        _complete(proxy, shared + tail, max_tokens=2).raise_for_status()
    moved = [a - b for a, b in zip(counts(), before, strict=True)]
    assert sorted(moved[:2]) == [0, 3] and sorted(moved[2:]) == [0, 3], moved
    assert moved[:2] == moved[2:]  # a prefix's home prefill and decode have the same index

    before = counts()
    for i in range(8):
        _complete(proxy, f"Case file {i * 11 + 1}. " + PASSAGE[:300], 2).raise_for_status()
    moved = [a - b for a, b in zip(counts(), before, strict=True)]
    assert sum(moved[:2]) == 8 and min(moved) >= 1, moved
    assert metric(proxy, "pdserve_proxy_prefix_fallbacks_total") == 0  # sequential: idle
    pools_whole(*prefill, *decode)


def test_prefix_policy_leaves_a_busy_home(cluster):
    proxy, prefill = cluster["prefix"].url, (cluster["p0"], cluster["p1"])

    def counts() -> list[float]:
        return [metric(proxy, "pdserve_proxy_backend_requests_total", backend=b) for b in prefill]

    before = counts()
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(_complete, proxy, "Case file 7. " + LONG, 2)
        _wait(lambda: metric(proxy, "pdserve_proxy_backend_outstanding", role="prefill") == 1)
        # Same prefix, but its home prefill is busy and the other is idle.
        _complete(proxy, "Case file 7. " + PASSAGE[:400] + "Why?", 2).raise_for_status()
        assert long.result().status_code == 200
    assert [a - b for a, b in zip(counts(), before, strict=True)] == [1, 1]
    assert metric(proxy, "pdserve_proxy_prefix_fallbacks_total", role="prefill") == 1
    pools_whole(*prefill, cluster["d0"], cluster["d1"])


def _wait(cond, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_a_conversations_next_turns_are_computed_only_where_new(cluster):
    """Turn 1 (long) is disaggregated; each later turn (the history, the answer and a short
    question) goes to the decode holding the history, which computes only what is new,
    and the answers equal a monolithic server's."""
    turns, p, decodes, ref = cluster["turns"].url, cluster["p1"], (cluster["d0"], cluster["d1"]), \
        cluster["p0"]
    history = PASSAGE[:1400]
    for i, question in enumerate(["Who landed on the Moon?", "In which year?",
                                  "Who stayed in orbit?"]):
        history += f"\nQ: {question}\nA:"
        before = {u: metric(u, "pdserve_prompt_tokens_computed_total") for u in (p, *decodes)}
        got = _complete(turns, history, max_tokens=12)
        assert _tokens(got) == _tokens(_complete(ref, history, max_tokens=12)), i
        computed = {u: metric(u, "pdserve_prompt_tokens_computed_total") - before[u]
                    for u in before}
        n = got.json()["usage"]["prompt_tokens"]
        if i == 0:  # disaggregated: the prefill computed it all
            assert computed[p] == n and sum(computed[d] for d in decodes) == 0, computed
        else:  # one decode, only the tail of the last block, the answer and the question
            assert computed[p] == 0 and 0 < sum(computed[d] for d in decodes) < 64 < n, \
                computed
            assert min(computed[d] for d in decodes) == 0  # the other decode: nothing
        history += got.json()["choices"][0]["text"]
    pools_whole(p, *decodes)
