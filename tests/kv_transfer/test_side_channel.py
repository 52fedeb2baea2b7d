"""The side channel under hostile peers, in-process over real sockets: malformed, truncated
and oversized messages, silent TCP peers and wrong secrets never stop the listener, and a
proper handshake still succeeds afterwards."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from pdserve.kv_transfer.side_channel import (
    MAX_MESSAGE_BYTES,
    HandshakeError,
    SecretRefused,
    SideChannelServer,
    handshake,
    release,
)
from tests.utils import free_port

SECRET = "s3cret-ключ"  # non-ASCII on purpose: secrets are compared as bytes
INFO = {"engine_id": "prefill-0", "agent_metadata": b"\x00meta"}


class Prefill:
    """A side-channel server with a recorded release callback."""

    def __init__(self, secret: str | None) -> None:
        self.released: list[str] = []
        self.port = free_port()
        self.server = SideChannelServer("127.0.0.1", self.port, lambda: INFO,
                                        self.released.append, secret)


@pytest.fixture
def open_prefill():
    p = Prefill(None)
    yield p
    p.server.close()


@pytest.fixture
def keyed_prefill():
    p = Prefill(SECRET)
    yield p
    p.server.close()


def _dealer(port: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _ask_raw(port: int, payload: bytes, timeout_ms: int = 2000) -> dict | None:
    """Send one raw frame the way handshake() does; the decoded reply, or None."""
    sock = _dealer(port)
    try:
        sock.send_multipart([b"", payload])
        if not sock.poll(timeout_ms):
            return None
        return msgspec.msgpack.decode(sock.recv_multipart()[-1])
    finally:
        sock.close()


def _assert_alive(port: int, secret: str | None = None) -> None:
    assert handshake("127.0.0.1", port, 5, secret) == INFO


TRUNCATED = msgspec.msgpack.encode({"type": "handshake", "secret": ""})[:-3]
JUNK = [
    (b"", "malformed"),
    (b"\xc1", "malformed"),  # a reserved msgpack opcode
    (TRUNCATED, "malformed"),
    (b"\x81\x81\xa1a\x01\x01", "malformed"),  # a map as a map key
    (msgspec.msgpack.encode([1, 2, 3]), "expected a handshake"),
    (msgspec.msgpack.encode("handshake"), "expected a handshake"),
    (msgspec.msgpack.encode({"type": ["handshake"]}), "expected a handshake"),
    (msgspec.msgpack.encode({"type": "shutdown"}), "expected a handshake"),
    (msgspec.msgpack.encode({"type": "release", "request_id": 7}), "request_id string"),
    (msgspec.msgpack.encode({"type": "release", "request_id": {"a": [1]}}),
     "request_id string"),
    (b"\xd4\x05\x00", "expected a handshake"),  # a msgpack extension type
]


@pytest.mark.parametrize("payload,word", JUNK, ids=[f"junk{i}" for i in range(len(JUNK))])
def test_malformed_messages_get_an_error_reply(open_prefill, payload, word):
    reply = _ask_raw(open_prefill.port, payload)
    assert reply is not None and word in reply["error"], reply
    _assert_alive(open_prefill.port)
    assert open_prefill.released == []


def test_hostile_peers_do_not_stop_the_listener(open_prefill, reliability_row):
    row = reliability_row(
        "side channel: malformed, truncated, oversized, odd frame counts, silent and "
        "non-ZMTP TCP peers", "sent each to a SideChannelServer in-process, then handshake()",
        "error replies or a dropped peer; the handshake still succeeds")
    port = open_prefill.port
    # Oversized: ZMQ's MAXMSGSIZE drops the peer without reading the whole message.
    assert _ask_raw(port, b"\x00" * (MAX_MESSAGE_BYTES + 1), 1000) is None
    # Odd frame counts: a lone frame (no delimiter), and many frames.
    for frames in ([TRUNCATED], [b""] * 20, [b"", b"", msgspec.msgpack.encode({})]):
        sock = _dealer(port)
        sock.send_multipart(frames)
        sock.poll(500)
        sock.close()
    # Plain TCP: one peer that connects and says nothing, one that sends HTTP, one that
    # sends a ZMTP greeting and vanishes halfway.
    silent = socket.create_connection(("127.0.0.1", port))
    with socket.create_connection(("127.0.0.1", port)) as talker:
        talker.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\xff" * 4096)
    with socket.create_connection(("127.0.0.1", port)) as half:
        half.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03")
    # Many peers at once that connect and leave without reading their reply.
    for _ in range(50):
        sock = _dealer(port)
        sock.send_multipart([b"", msgspec.msgpack.encode({"type": "handshake"})])
        sock.close()
    start = time.monotonic()
    _assert_alive(port)  # while the silent peer is still connected
    took = time.monotonic() - start
    silent.close()
    _assert_alive(port)
    assert open_prefill.released == []
    row.observed(f"oversized peer dropped with no reply; handshake answered in {took:.3f}s "
                 "with a silent peer connected; no release triggered")


def test_wrong_secret_is_refused_with_a_clear_message(keyed_prefill, reliability_row):
    row = reliability_row("side channel: wrong, missing or non-ASCII secret",
                          "handshake()/release() to a keyed SideChannelServer",
                          "SecretRefused naming side_channel_secret; nothing released; "
                          "the right secret still works")
    port = keyed_prefill.port
    for secret in (None, "", "wrong", SECRET + "x", SECRET[:-1], "é" * 1000):
        with pytest.raises(SecretRefused, match="wrong or missing side_channel_secret"):
            handshake("127.0.0.1", port, 5, secret)
        with pytest.raises(SecretRefused, match="side_channel_secret"):
            release("127.0.0.1", port, "req-1", 5, secret)
    # A secret of the wrong type is refused too, not a crash.
    for secret in (123, None, [SECRET], {"s": SECRET}, SECRET.encode()):
        payload = msgspec.msgpack.encode({"type": "handshake", "secret": secret})
        assert "side_channel_secret" in _ask_raw(port, payload)["error"]
    assert keyed_prefill.released == []
    _assert_alive(port, SECRET)
    release("127.0.0.1", port, "req-1", 5, SECRET)
    assert keyed_prefill.released == ["req-1"]
    with pytest.raises(SecretRefused) as e:
        handshake("127.0.0.1", port, 5, "wrong")
    message = str(e.value).replace(str(port), "PORT")
    row.observed(f"SecretRefused: {message}; right secret: handshake and release ok")


def test_a_failing_answer_is_an_error_reply_not_a_dead_listener():
    calls = []

    def answer() -> dict:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("agent not ready")
        return INFO

    port = free_port()
    server = SideChannelServer("127.0.0.1", port, answer, lambda rid: None)
    try:
        with pytest.raises(HandshakeError, match="agent not ready"):
            handshake("127.0.0.1", port, 5, None)
        _assert_alive(port)
    finally:
        server.close()


def test_no_listener_is_a_bounded_handshake_error():
    start = time.monotonic()
    with pytest.raises(HandshakeError, match="no answer"):
        handshake("127.0.0.1", free_port(), 0.5, None)
    assert time.monotonic() - start < 3
