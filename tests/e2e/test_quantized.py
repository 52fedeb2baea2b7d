"""Quantized weights served for real: P/D over NIXL token for token equal to the same weights
served monolithically, prompts prefilled in several chunks included. int4 (Q4_0, quantized at
load), the embedded GGUF file as stored (Q4_1 with its mins, a Q8_0 embedding and lm_head)
with an fp8 KV cache, and a checkpoint compressed-tensors wrote (asymmetric int4, served in
its own format without a flag); int8 (Q8_0) runs the same kernel with another unpacking
(tests/model/test_quant.py)."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.cluster import kv_config, pools_whole, remote_pd, serve, stop
from tests.utils import PASSAGE, metric, write_compressed

PROMPTS = ["The capital of France is", PASSAGE[:300], PASSAGE * 2]  # the last: 2 chunks of 512


CASES = {"int4": ["--quantization", "int4"],
         "gguf-fp8-kv": ["--quantization", "gguf", "--kv-cache-dtype", "fp8"],  # fp8 pulls
         "compressed-tensors": None}  # a random Llama's checkpoint, made by the fixture


@pytest.fixture(scope="module", params=CASES)
def pair(request, tiny_llama, tmp_path_factory):
    flags = CASES[request.param]
    if flags is None:
        folder = write_compressed(tiny_llama, tmp_path_factory.mktemp("w4a16"), "pack-quantized",
                                  num_bits=4, type="int", strategy="group", group_size=32,
                                  symmetric=False)
        flags = ["--model", str(folder)]
    # kv_both: the prefill serves plain requests too, as a monolith with the same weights.
    flags = [*flags, "--max-model-len", "1024"]
    prefill, decode = serve(kv_config(), *flags), serve(kv_config(), *flags)
    yield prefill, decode
    stop(prefill, decode)


def _body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 1}


def test_pd_equals_monolithic_with_quantized_weights(pair):
    prefill, decode = pair
    pulled = metric(decode.url, "pdserve_kv_transfers_total")
    for prompt in PROMPTS:
        # the prefill as the monolith: the decode's prefix cache stays cold for the pulls
        want = httpx.post(prefill.url + "/v1/completions", json=_body(prompt), timeout=120)
        got = remote_pd(prefill.url, decode.url, _body(prompt))
        assert got.status_code == want.status_code == 200, got.text
        w, g = want.json()["choices"][0], got.json()["choices"][0]
        assert g["text"] == w["text"] and g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
        # the decode's logprobs come from the same integer products: exactly equal
        assert g["logprobs"]["token_logprobs"][1:] == w["logprobs"]["token_logprobs"][1:]
    assert metric(decode.url, "pdserve_kv_transfers_total") - pulled == len(PROMPTS)
    pools_whole(prefill.url, decode.url)
