"""API keys on servers and the proxy, the side-channel secret between prefill and decode,
and where the side channel listens."""

from __future__ import annotations

import httpx
import psutil
import pytest

from tests.e2e.cluster import MODEL, healthy, kv_config, pools_whole, proxy, serve, stop
from tests.utils import metric

KEY, ENV_KEY, SECRET = "sk-test-key", "sk-from-env", "side-secret"
BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0}


@pytest.fixture(scope="module")
def keyed():
    """A keyed 1P1D (same side-channel secret) behind a keyed proxy, plus a decode whose
    key comes from PDSERVE_API_KEY and that has no side-channel secret."""
    kv = kv_config("fail", side_channel_secret=SECRET, kv_lease_duration=2)
    prefill = serve(kv, "--api-key", KEY)
    decode = serve(kv, "--api-key", KEY)
    front = proxy(prefill, decode, "--api-key", KEY)
    stranger = serve(kv_config("fail", kv_lease_duration=2), env={"PDSERVE_API_KEY": ENV_KEY})
    yield prefill, decode, front, stranger
    stop(front, prefill, decode, stranger)


def _auth(key: str | None) -> dict[str, bytes]:
    return {"Authorization": f"Bearer {key}".encode()} if key else {}  # bytes: non-ASCII too


def _assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and "API key" in err["message"]
    assert err["code"] == 401


@pytest.mark.parametrize("who", ["server", "env-server", "proxy"])
def test_api_key_required_on_v1_and_health_stays_open(keyed, who, reliability_row):
    prefill, decode, front, stranger = keyed
    url, key = {"server": (decode.url, KEY), "env-server": (stranger.url, ENV_KEY),
                "proxy": (front.url, KEY)}[who]
    row = reliability_row(f"API key ({who}{': PDSERVE_API_KEY' if who == 'env-server' else ''})",
                          "requests without, with a wrong and with the right Bearer key",
                          "401 OpenAI-style error without/wrong; 200 with it; /health open")
    for bad in (None, "wrong", key + "x", "", "é"):
        for path in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
            _assert_401(httpx.post(url + path, json=BODY, headers=_auth(bad), timeout=10)
                        if path != "/v1/models" else
                        httpx.get(url + path, headers=_auth(bad), timeout=10))
    _assert_401(httpx.post(url + "/v1/completions", json=BODY, timeout=10,
                           headers={"Authorization": key}))  # not a Bearer
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.get(url + "/v1/models", headers=_auth(key), timeout=10).status_code == 200
    r = httpx.post(url + "/v1/completions", json=BODY, headers=_auth(key), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(url + "/v1/chat/completions", json=chat, headers=_auth(key), timeout=60)
    assert r.status_code == 200, r.text
    row.observed("401 authentication_error on 16 unauthenticated requests; 200 with the key; "
                 "/health 200 without it")


def test_keyed_proxy_forwards_its_key_to_keyed_backends(keyed, reliability_row):
    prefill, decode, front, _ = keyed
    row = reliability_row("API key on proxy and backends", "1P1D, all three keyed, driven "
                          "through the proxy", "the proxy passes its key on: 200, KV pulled")
    before = metric(decode.url, "pdserve_kv_transfers_total")
    r = httpx.post(front.url + "/v1/completions", json=BODY, headers=_auth(KEY), timeout=60)
    assert r.status_code == 200, r.text
    assert metric(decode.url, "pdserve_kv_transfers_total") == before + 1
    pools_whole(prefill.url, decode.url)
    row.observed("200; the decode pulled the prompt's KV from the prefill (1 transfer)")


def test_backend_api_key_flag(keyed, reliability_row):
    prefill, decode, _, _ = keyed
    row = reliability_row("proxy --backend-api-key", "a proxy with no client key and "
                          "--backend-api-key, then one with a wrong backend key",
                          "the right backend key works; a wrong one relays the backends' 401")
    open_front = proxy(prefill, decode, "--backend-api-key", KEY)
    wrong = proxy(prefill, decode, "--api-key", KEY, "--backend-api-key", "nope")
    try:
        r = httpx.post(open_front.url + "/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(wrong.url + "/v1/completions", json=BODY, headers=_auth(KEY), timeout=60)
        _assert_401(r)
    finally:
        stop(open_front, wrong)
    row.observed("200 with --backend-api-key; the backends' 401 relayed with a wrong one")


@pytest.mark.parametrize("secret,policy", [(None, "fail"), ("another-secret", "fail"),
                                           ("another-secret", "recompute")])
def test_decode_without_the_secret_is_refused_at_handshake(keyed, secret, policy,
                                                           reliability_row):
    prefill, _, _, stranger = keyed
    which = "another" if secret else "no"
    # A refused secret is a misconfiguration, not a transient failure: never recomputed.
    row = reliability_row(f"side_channel_secret: decode with {which} secret ({policy})",
                          "prefill keyed with a secret; a decode without it pulls its KV",
                          "refused at handshake, a clear error to the client whatever the "
                          "policy; both servers healthy, no blocks leaked (the lease frees "
                          "the prefill's)")
    decode = stranger if secret is None else serve(
        kv_config(policy, side_channel_secret=secret), "--api-key", ENV_KEY)
    try:
        r = httpx.post(prefill.url + "/v1/completions", headers=_auth(KEY), timeout=60,
                       json={**BODY, "max_tokens": 1,
                             "kv_transfer_params": {"do_remote_decode": True}})
        params = r.json()["kv_transfer_params"]
        r = httpx.post(decode.url + "/v1/completions", headers=_auth(ENV_KEY), timeout=60,
                       json={**BODY, "kv_transfer_params": params})
        message = r.json()["error"]["message"]
        assert r.status_code >= 500 and "side_channel_secret" in message, r.text
        assert metric(decode.url, "pdserve_kv_transfers_total") == 0
        healthy(prefill, decode)
        took = pools_whole(decode.url, prefill.url)  # the prefill's lease (2 s) ran out
    finally:
        if decode is not stranger:
            decode.stop()
    message = message.replace(str(params["remote_port"]), "PORT")
    row.observed(f"{r.status_code}: {message}; pools whole after {took:.1f}s")


def test_the_side_channel_listens_on_its_host_only(keyed, reliability_row):
    prefill = keyed[0]
    row = reliability_row("side-channel bind address", "listening sockets of the prefill's "
                          "side-channel port (psutil)", "127.0.0.1 only (its configured host)")
    port = httpx.get(prefill.url + "/v1/kv_transfer/info", headers=_auth(KEY)).json()[
        "ranks"][0]["side_channel_port"]
    addrs = {c.laddr.ip for c in psutil.net_connections("inet")
             if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert addrs == {"127.0.0.1"}, addrs
    row.observed(f"listening on {sorted(addrs)}")
