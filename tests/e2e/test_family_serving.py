"""P/D and tensor parallelism for the model families beside Llama, on real processes: for
each, a prefill and a decode (kv_both servers of a small random model made by transformers),
the disaggregated answer equal to the decode's monolithic one token for token, the pools
whole after (sliding-window models pull, for their sliding layers, only the blocks the
window still sees); and a TP=2 server (heads, MLP and experts split, Phi-3's fused weights split
before slicing) answering as transformers does (the near-tie rule)."""

from __future__ import annotations

import httpx
import pytest
import torch

from pdserve.model.llama import ModelConfig
from tests.e2e.cluster import kv_config, pools_whole, remote_pd, serve, stop
from tests.utils import (
    FAMILIES,
    NEAR_TIE,
    hf_greedy,
    metric,
    write_family_model,
)

PROMPTS = [[1, 504, 3458, 282, 4649], list(range(100, 140))]
BODY = {"max_tokens": 8, "temperature": 0, "logprobs": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, model_folder, tmp_path_factory):
    return write_family_model(request.param, tmp_path_factory.mktemp(request.param),
                              model_folder)


@pytest.fixture(scope="module")
def pair(family):
    # No prefix cache: the decode's own monolithic run would leave nothing to pull.
    servers = [serve(kv_config(), "--model", str(family), "--no-prefix-caching")
               for _ in range(2)]
    yield [s.url for s in servers]
    stop(*servers)


def _tokens(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_pd_equals_monolithic(family, pair):
    prefill, decode = pair
    for prompt in PROMPTS:
        want = _tokens(httpx.post(decode + "/v1/completions", timeout=120,
                                  json={**BODY, "prompt": prompt}))
        pulled = metric(decode, "pdserve_kv_transfers_total")
        assert _tokens(remote_pd(prefill, decode, {**BODY, "prompt": prompt})) == want
        assert metric(decode, "pdserve_kv_transfers_total") == pulled + 1
    # The 40-token prompt's first block lies before a 16-token window's: not pulled.
    windowed = any(ModelConfig.from_folder(family).layer_windows)
    assert (metric(decode, "pdserve_kv_transfer_bytes_saved_total") > 0) == windowed
    pools_whole(prefill, decode)


def test_tp2_answers_as_transformers(family, tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(family, dtype=torch.float32).eval()
    tp2 = serve(None, "--model", str(family), "--tensor-parallel-size", "2", timeout=300)
    try:
        for prompt in PROMPTS:
            body = {**BODY, "prompt": prompt}
            got = _tokens(httpx.post(tp2.url + "/v1/completions", timeout=120, json=body))
            ref = hf_greedy(hf, prompt, BODY["max_tokens"])
            want = [tokenizer.decode([t]) for t in ref.tokens]
            i = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b),
                     None)
            assert i is None or ref.margins[i] < NEAR_TIE, (family.name, i, got, want)
    finally:
        tp2.stop()
