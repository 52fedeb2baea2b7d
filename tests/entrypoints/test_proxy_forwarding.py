"""What the proxy sends its backends, seen by a tiny in-test backend (bookkeeping only; the
real prefill/decode path is tests/e2e/test_proxy.py): one request id on both legs and in
the answer, the prefill leg's body, and the prefill's kv_transfer_params handed on."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.utils import start_server

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [3],
          "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 1}


class _Backend(BaseHTTPRequestHandler):
    seen: list[tuple[str, dict]] = []  # (X-Request-Id, body) in arrival order

    def do_GET(self):  # /health
        self._answer({"status": "ok"})

    def do_POST(self):
        self.body = body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.headers["X-Request-Id"], body))
        prefill = (body.get("kv_transfer_params") or {}).get("do_remote_decode")
        self._answer({"id": "x", "choices": [{"index": 0, "text": "ok"}],
                      "kv_transfer_params": PARAMS if prefill else None})

    def _answer(self, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_):
        pass


@pytest.fixture(scope="module")
def proxy():
    backend = ThreadingHTTPServer(("127.0.0.1", 0), _Backend)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{backend.server_address[1]}"
    server = start_server(["proxy", "--prefill", url, "--decode", url])
    yield server
    server.stop()
    backend.shutdown()


@pytest.mark.parametrize("given", ["client-id-42", None])
def test_one_request_id_on_both_legs_and_in_the_answer(proxy, given):
    _Backend.seen.clear()
    headers = {"X-Request-Id": given} if given else {}
    r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 5},
                   headers=headers, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    rid = r.headers["x-request-id"]
    assert rid == given or (given is None and len(rid) == 32)
    (prefill_id, prefill), (decode_id, decode) = _Backend.seen
    assert prefill_id == decode_id == rid
    assert prefill["max_tokens"] == 1 and prefill["kv_transfer_params"]["do_remote_decode"]
    assert decode["max_tokens"] == 5 and decode["kv_transfer_params"] == PARAMS
    assert f"request {rid}: prefill " in proxy.log()


def test_an_unusable_request_id_is_refused(proxy):
    for bad in ("x" * 300, "caf\xe9", "two words"):
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "Hi"},
                       headers={"X-Request-Id": bad.encode("latin-1")}, timeout=30)
        assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"], bad
        assert len(r.headers["x-request-id"]) == 32  # a fresh one, to find it in the log
    assert httpx.get(proxy.url + "/health", timeout=10).status_code == 200


class _Draining(_Backend):
    seen: list[tuple[str, dict]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.headers["X-Request-Id"], body))
        data = b'{"error": {"message": "the server is shutting down (draining)"}}'
        self.send_response(503)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _backend(handler) -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_a_draining_backend_is_passed_over():
    (ok, ok_url), (drain, drain_url) = _backend(_Backend), _backend(_Draining)
    # Round robin starts with the draining one in both tiers.
    server = start_server(["proxy", "--prefill", drain_url, ok_url,
                           "--decode", drain_url, ok_url])
    try:
        _Backend.seen.clear()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 5},
                       timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
        # The prefill tier moved on at once; the draining decode refused the prefilled
        # request, so it was prefilled again and decoded on the other one.
        legs = [("decode" if b["kv_transfer_params"].get("do_remote_prefill") else "prefill")
                for _, b in _Draining.seen]
        assert legs == ["prefill", "decode"]
        assert [b["max_tokens"] for _, b in _Backend.seen] == [1, 1, 5]
    finally:
        server.stop()
        ok.shutdown()
        drain.shutdown()


def test_a_body_over_the_limit_is_a_413_and_reaches_no_backend():
    backend = ThreadingHTTPServer(("127.0.0.1", 0), _Backend)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{backend.server_address[1]}"
    proxy = start_server(["proxy", "--prefill", url, "--decode", url,
                          "--max-request-bytes", "1000"])
    try:
        _Backend.seen.clear()
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x" * 2000},
                       timeout=30)
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
        assert not _Backend.seen
        ok = httpx.post(proxy.url + "/v1/completions", json={"prompt": "Hi"}, timeout=30)
        assert ok.status_code == 200 and len(_Backend.seen) == 2
    finally:
        proxy.stop()
        backend.shutdown()
