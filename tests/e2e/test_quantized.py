"""Quantized weights served for real: P/D over NIXL token for token equal to the same weights
served monolithically, prompts prefilled in several chunks included. int4 (Q4_0, quantized at
load), the embedded GGUF file as stored (Q4_1 with its mins, a Q8_0 embedding and lm_head)
with an fp8 KV cache, and a checkpoint compressed-tensors wrote (asymmetric int4, served in
its own format without a flag); int8 (Q8_0) runs the same kernel with another unpacking
(tests/model/test_quant.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import kv_config, pools_whole, remote_pd, serve, stop
from tests.utils import NEAR_TIE, PASSAGE, free_port, metric, start_server, write_compressed

PROMPTS = ["The capital of France is", PASSAGE[:300], PASSAGE * 2]  # the last: 2 chunks of 512


CASES = {"int4": ["--quantization", "int4"],
         "gguf-fp8-kv": ["--quantization", "gguf", "--kv-cache-dtype", "fp8"],  # fp8 pulls
         "compressed-tensors": None}  # a random Llama's checkpoint, made by the fixture


@pytest.fixture(scope="module")
def checkpoint(tiny_llama, tmp_path_factory) -> Path:
    """A random 8-head Llama (tensor parallelism splits it) as compressed-tensors writes W4A16:
    asymmetric int4 in groups of 32."""
    return write_compressed(tiny_llama, tmp_path_factory.mktemp("w4a16"), "pack-quantized",
                            num_bits=4, type="int", strategy="group", group_size=32,
                            symmetric=False)


@pytest.fixture(scope="module", params=CASES)
def pair(request, checkpoint):
    flags = CASES[request.param] or ["--model", str(checkpoint)]
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


def test_tensor_parallel_serves_quantized_weights(checkpoint):
    """TP=2 on int4 weights: each rank's slice of q/k/v and gate/up rows, and of o and down
    columns (whole groups of 32), computed as stored; greedy output equal to TP=1's up to
    near-ties (the row-parallel products' partial sums are added in another order), and
    P/D from a TP=1 prefill into the TP=2 decode equal to the TP=2 decode alone."""
    tp = {size: start_server([
        "serve", "--model", str(checkpoint), "--dtype", "float32", "--num-kv-blocks", "64",
        "--tensor-parallel-size", str(size), "--kv-transfer-config", kv_config(),
        "--kv-side-channel-port", str(free_port(count=size))], timeout=300) for size in (1, 2)}
    try:
        body = {**_body(PASSAGE[:300]), "logprobs": 2}
        one, two = (httpx.post(tp[n].url + "/v1/completions", json=body, timeout=120).json()
                    ["choices"][0]["logprobs"] for n in (1, 2))
        parted = next((i for i, (a, b) in enumerate(zip(one["tokens"], two["tokens"],
                                                        strict=True)) if a != b), None)
        if parted is not None:
            top = sorted(one["top_logprobs"][parted].values(), reverse=True)
            assert top[0] - top[1] < NEAR_TIE, (parted, one["tokens"], two["tokens"])
        pulled = metric(tp[2].url, "pdserve_kv_transfers_total")
        got = remote_pd(tp[1].url, tp[2].url, body).json()["choices"][0]["logprobs"]
        assert got["tokens"] == two["tokens"]
        assert metric(tp[2].url, "pdserve_kv_transfers_total") == pulled + 1
        pools_whole(tp[1].url, tp[2].url)
    finally:
        stop(*tp.values())
