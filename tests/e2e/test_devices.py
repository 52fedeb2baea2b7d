"""KV buffer combinations (the host-buffer path that XPU/CUDA take, forced on CPU with
use_host_buffer), a layout converted on receive, and handshake refusals, on real
processes."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.cluster import remote_pd
from tests.utils import free_port, metric, start_server, wait_for_metric

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["Hi", "The capital of France is", "def add(a, b):",
           "Write a short poem about autumn leaves falling. " * 3,
           "Explain how a bicycle works. " * 10, "1, 2, 3, 5, 8, 13,",
           "Translate to French: the cat sleeps on the warm windowsill.",
           "A long story begins here. " * 40]


def _serve(dtype="float32", layout="NHD", host_buffer=None, role="kv_both"):
    args = ["serve", "--dtype", dtype, "--kv-cache-memory", "0.2", "--kv-layout", layout,
            "--port", str(free_port())]
    if host_buffer is not None:
        kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
              "kv_connector_extra_config": {"use_host_buffer": host_buffer}}
        args += ["--kv-transfer-config", json.dumps(kv),
                 "--kv-side-channel-port", str(free_port())]
    return start_server(args)


@pytest.fixture(scope="module")
def servers():
    specs = {"mono": {}, "p_host": {"host_buffer": True}, "d_host": {"host_buffer": True},
             "d_plain": {"host_buffer": False}, "d_hnd": {"host_buffer": False, "layout": "HND"},
             "d_bf16": {"host_buffer": False, "dtype": "bfloat16"}}
    started = {}
    try:
        for name, spec in specs.items():
            started[name] = _serve(**spec)
        yield started
    finally:
        for s in started.values():
            s.stop()


def _pd(prefill: str, decode: str, prompt: str) -> httpx.Response:
    return remote_pd(prefill, decode, {"model": MODEL, "prompt": prompt, "max_tokens": 20,
                                       "temperature": 0})


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("decode", ["d_host", "d_plain", "d_hnd"])  # d_hnd: converted
def test_host_buffer_prefill_to_each_decode_matches_monolithic(servers, decode):
    p, d, mono = servers["p_host"].url, servers[decode].url, servers["mono"].url
    before = metric(d, "pdserve_kv_transfer_bytes_total")
    for prompt in PROMPTS:
        want = _text(httpx.post(mono + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0}))
        assert _text(_pd(p, d, prompt)) == want, (decode, prompt)
    assert metric(d, "pdserve_kv_transfer_bytes_total") > before
    assert metric(d, "pdserve_prompt_tokens_computed_total") == 0
    _assert_whole(p, d)


def test_incompatible_kv_is_refused_clearly(servers):
    p, d = servers["p_host"].url, servers["d_bf16"].url
    words = ["dtype", "float32", "bfloat16"]
    r = _pd(p, d, "A prompt for an incompatible pair of servers.")
    message = r.json()["error"]["message"]
    assert r.status_code >= 400 and "incompatible" in message, r.text
    assert all(w in message for w in words), message
    for url in (p, d):
        assert httpx.get(url + "/health").status_code == 200
    _assert_whole(p, d)
    assert _text(httpx.post(d + "/v1/completions", json={  # still serving
        "model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60))


def _assert_whole(*urls: str) -> None:
    for url in urls:
        wait_for_metric(url, "pdserve_kv_blocks_free", metric(url, "pdserve_kv_blocks_total"))
