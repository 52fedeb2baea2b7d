"""A decode whose KV pool runs out preempts remote-prefilled requests and recomputes them
itself (their pulled KV went with their blocks): every request completes in full and both
pools are whole afterwards. Found on a GPU decode under load, where the engine asked the
connector for the preempted request's finished pull and failed every request it held."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.e2e.cluster import MODEL, healthy, kv_config, pools_whole, remote_pd, serve, stop
from tests.utils import PASSAGE, metric

# Four requests of ~13 blocks each against a decode pool of 24 blocks.
PROMPTS = [PASSAGE[i * 40:i * 40 + 480] for i in range(4)]
MAX_TOKENS = 80


def _pd(prefill: str, decode: str, prompt: str) -> httpx.Response:
    return remote_pd(prefill, decode, {"model": MODEL, "prompt": prompt,
                                       "max_tokens": MAX_TOKENS, "temperature": 0,
                                       "ignore_eos": True})


def test_a_decode_out_of_blocks_recomputes_preempted_remote_requests():
    prefill, decode = serve(kv_config()), serve(kv_config(), "--num-kv-blocks", "24")
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda p: _pd(prefill.url, decode.url, p), PROMPTS))
        for r in answers:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
        assert metric(decode.url, "pdserve_num_preemptions_total") > 0
        assert metric(decode.url, "pdserve_kv_transfer_bytes_total") > 0
        pools_whole(prefill.url, decode.url)
        healthy(prefill, decode)
    finally:
        stop(prefill, decode)
