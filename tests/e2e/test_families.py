"""P/D for the model families beside Llama over real NIXL: for each, a prefill and a decode
(kv_both servers of a small random model made by transformers), the disaggregated answer
equal to the decode's monolithic one token for token, the pools whole after."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.cluster import kv_config, pools_whole, remote_pd, serve, stop
from tests.utils import FAMILIES, metric, write_family_model

PROMPTS = [[1, 504, 3458, 282, 4649], list(range(100, 140))]
BODY = {"max_tokens": 8, "temperature": 0, "logprobs": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, model_folder, tmp_path_factory):
    folder = write_family_model(request.param, tmp_path_factory.mktemp(request.param),
                                model_folder)
    # No prefix cache: the decode's own monolithic run would leave nothing to pull.
    servers = [serve(kv_config(), "--model", str(folder), "--no-prefix-caching")
               for _ in range(2)]
    yield [s.url for s in servers]
    stop(*servers)


def _tokens(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_pd_equals_monolithic(pair):
    prefill, decode = pair
    for prompt in PROMPTS:
        want = _tokens(httpx.post(decode + "/v1/completions", timeout=120,
                                  json={**BODY, "prompt": prompt}))
        pulled = metric(decode, "pdserve_kv_transfers_total")
        assert _tokens(remote_pd(prefill, decode, {**BODY, "prompt": prompt})) == want
        assert metric(decode, "pdserve_kv_transfers_total") == pulled + 1
    pools_whole(prefill, decode)
