"""CUDA end to end: a prefill and a decode on the GPU, the KV read by NIXL straight from VRAM
(kv_buffer_device cuda) or staged through pinned host memory (cpu), in every pairing, give
the monolithic CUDA server's tokens exactly; skipped where torch sees no CUDA device."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.e2e.cluster import pools_whole, remote_pd
from tests.utils import free_port, metric, start_server

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["Hi", "The capital of France is", "def add(a, b):",
           "Explain how a bicycle works. " * 10, "A long story begins here. " * 40]
BUFFERS = {"mono": None, "p_vram": "cuda", "d_vram": "cuda", "p_host": "cpu", "d_host": "cpu"}


@pytest.fixture(scope="module")
def servers(model_folder):
    started = {}
    try:
        for name, buffer in BUFFERS.items():
            args = ["serve", "--device", "cuda", "--model", str(model_folder),
                    "--dtype", "bfloat16", "--num-kv-blocks", "256"]
            if buffer:
                kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                      "kv_buffer_device": buffer}
                args += ["--kv-transfer-config", json.dumps(kv),
                         "--kv-side-channel-port", str(free_port())]
            started[name] = start_server(args, timeout=300)
        yield {name: s.url for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


def _tokens(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


@pytest.mark.parametrize(("prefill", "decode"), [("p_vram", "d_vram"), ("p_host", "d_host"),
                                                 ("p_vram", "d_host"), ("p_host", "d_vram")])
def test_pd_matches_monolithic(servers, prefill, decode):
    p, d = servers[prefill], servers[decode]
    pulled, computed = (metric(d, f"pdserve_{m}_total")
                        for m in ("kv_transfer_bytes", "prompt_tokens_computed"))
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 0}
        want = _tokens(httpx.post(servers["mono"] + "/v1/completions", timeout=120, json=body))
        assert _tokens(remote_pd(p, d, body)) == want, (prefill, decode, prompt)
    assert metric(d, "pdserve_kv_transfer_bytes_total") > pulled
    assert metric(d, "pdserve_prompt_tokens_computed_total") == computed  # all KV came over
    pools_whole(p, d)
