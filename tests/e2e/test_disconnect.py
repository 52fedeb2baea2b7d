"""Clients that go away mid-generation through the proxy (1P1D): the decode aborts the
request and frees its blocks, the prefill has freed its own, nothing stays running."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.cluster import MODEL, healthy, kv_config, pools_whole, proxy, serve, stop
from tests.utils import metric

PROMPT = "Write a very long story about a lighthouse keeper and the sea. " * 4
LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True,
        "temperature": 0}


@pytest.fixture(scope="module")
def pd():
    prefill, decode = serve(kv_config()), serve(kv_config())
    front = proxy(prefill, decode)
    yield prefill, decode, front
    stop(front, prefill, decode)


def _generated(url: str) -> float:
    return metric(url, "pdserve_generation_tokens_total")


def _assert_stopped_early(decode: str, before: float) -> float:
    """The decode stopped generating soon after the client left (far short of max_tokens)."""
    time.sleep(1.0)
    first = _generated(decode)
    time.sleep(1.0)
    assert _generated(decode) == first, "the decode is still generating for a gone client"
    made = first - before
    assert made < LONG["max_tokens"] / 2, made
    return made


def test_streaming_client_closes_after_a_few_chunks(pd, reliability_row):
    prefill, decode, front = pd
    row = reliability_row("client disconnect: streaming", "through the proxy (1P1D), read 5 "
                          "SSE chunks of a 1500-token generation, then close the connection",
                          "decode aborts; both KV pools whole, 0 running, within seconds")
    before = _generated(decode.url)
    with httpx.stream("POST", front.url + "/v1/completions", json={**LONG, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 5:
                break
    left = time.monotonic()
    took = pools_whole(decode.url, prefill.url)
    made = _assert_stopped_early(decode.url, before)
    healthy(prefill, decode, front)
    row.observed(f"pools whole and 0 running {took:.1f}s after the close; the decode made "
                 f"{made:.0f} of 1500 tokens")
    assert time.monotonic() - left < 30


def test_non_streaming_client_times_out(pd, reliability_row):
    prefill, decode, front = pd
    row = reliability_row("client disconnect: non-streaming timeout", "through the proxy "
                          "(1P1D), a 1500-token request with a 2 s client read timeout",
                          "decode aborts; both KV pools whole, 0 running, within seconds")
    before = _generated(decode.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(front.url + "/v1/completions", json=LONG, timeout=2)
    took = pools_whole(decode.url, prefill.url)
    made = _assert_stopped_early(decode.url, before)
    healthy(prefill, decode, front)
    row.observed(f"pools whole and 0 running {took:.1f}s after the timeout; the decode made "
                 f"{made:.0f} of 1500 tokens")


def test_server_still_answers_after_the_disconnects(pd):
    prefill, decode, front = pd
    r = httpx.post(front.url + "/v1/completions", json={**LONG, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    pools_whole(decode.url, prefill.url)
