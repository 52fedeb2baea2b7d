"""P/D between unlike instances over real NIXL: a decode reads a prefill of another KV layout
(converted on receive) or of a smaller block size, token-identical to its own monolithic
answer, without recomputing the prompt; what cannot be converted is refused at handshake
with a message naming it, and both servers keep serving with their pools whole."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.cluster import kv_config, pools_whole, remote_pd, serve, stop
from tests.utils import metric

# Three kv_both servers, each a prefill, a decode and its own monolithic reference.
SERVERS = {"nhd16": ("NHD", 16), "hnd16": ("HND", 16), "hnd64": ("HND", 64),
           "nhd32": ("NHD", 32)}
PROMPTS = ["The capital of France is",  # one block
           "Write a short story about a robot who learns to paint. " * 8]  # several
BODY = {"max_tokens": 8, "temperature": 0, "logprobs": 0}


@pytest.fixture(scope="module")
def servers():
    started = {}
    try:
        for name, (layout, block) in SERVERS.items():
            started[name] = serve(kv_config(), "--kv-layout", layout, "--block-size", str(block))
        yield {name: s.url for name, s in started.items()}
    finally:
        stop(*started.values())


def _tokens(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


@pytest.mark.parametrize(("prefill", "decode"), [
    ("nhd16", "hnd16"), ("hnd16", "nhd16"),  # layout converted on receive
    ("hnd16", "hnd64"), ("nhd16", "nhd32"),  # 4 or 2 prefill blocks to a decode block
    ("nhd16", "hnd64"), ("hnd16", "nhd32")])  # both at once
def test_unlike_pairs_match_the_decodes_own_answer(servers, prefill, decode):
    p, d = servers[prefill], servers[decode]
    for prompt in PROMPTS:
        want = _tokens(httpx.post(d + "/v1/completions", timeout=120,
                                  json={**BODY, "prompt": prompt}))
        computed = metric(d, "pdserve_prompt_tokens_computed_total")
        converted = metric(d, "pdserve_kv_converted_pulls")
        got = _tokens(remote_pd(p, d, {**BODY, "prompt": prompt}))
        assert got == want, (prefill, decode, prompt)
        assert metric(d, "pdserve_prompt_tokens_computed_total") == computed, \
            "the decode recomputed the prompt instead of reading its KV"
        assert metric(d, "pdserve_kv_converted_pulls") == converted + 1
    pools_whole(p, d)


def test_a_prefill_of_larger_blocks_is_refused_by_name(servers):
    p, d = servers["hnd64"], servers["nhd16"]
    r = remote_pd(p, d, {**BODY, "prompt": PROMPTS[1]})
    assert r.status_code >= 400, r.text
    message = r.json()["error"]["message"]
    assert "a decode's --block-size must be a multiple of the prefill's" in message, message
    pools_whole(p, d)  # the refused decode gave the prefill its blocks back
    for url in (p, d):  # both still serve
        assert _tokens(httpx.post(url + "/v1/completions", timeout=120,
                                  json={**BODY, "prompt": PROMPTS[0]}))
