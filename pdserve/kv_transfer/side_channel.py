"""The side channel: a ZMQ socket where a prefill rank tells decodes how to read its KV
(NIXL agent metadata, base address, layout). Bad messages get an error reply; nothing a
peer sends can stop the listener."""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import msgspec
import zmq

from pdserve.config import ConfigError
from pdserve.kv_transfer.transport import Misconfigured

log = logging.getLogger("pdserve.kv_transfer")

MAX_MESSAGE_BYTES = 64 * 1024  # a handshake request is tiny; anything larger is refused


class HandshakeError(RuntimeError):
    pass


class SecretRefused(HandshakeError, Misconfigured):
    """The prefill refused our side_channel_secret."""


class SideChannelServer:
    def __init__(self, host: str, port: int, answer: Callable[[], dict[str, Any]],
                 release: Callable[[str], None], secret: str | None = None) -> None:
        self._answer, self._release, self._secret = answer, release, secret
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(f"tcp://{_bracket(host)}:{port}")
        except zmq.ZMQError as e:
            self._sock.close()
            raise ConfigError(f"cannot listen for KV handshakes on {host}:{port} "
                              f"(--kv-side-channel-port): {e.strerror}") from None
        self.host, self.port = host, port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-side-channel", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) < 2:
                continue
            try:
                reply = self._reply(frames[-1])
            except Exception as e:  # whatever a peer sends, the listener keeps serving
                log.exception("side-channel message handling failed")
                reply = {"error": f"bad side-channel message: {type(e).__name__}"}
            with suppress(zmq.ZMQError):  # the peer left before we answered
                self._sock.send_multipart([frames[0], b"", msgspec.msgpack.encode(reply)])
        self._sock.close()

    def _reply(self, raw: bytes) -> dict[str, Any]:
        try:
            msg = msgspec.msgpack.decode(raw)
        except msgspec.DecodeError:
            return {"error": "malformed handshake message"}
        if not isinstance(msg, dict) or msg.get("type") not in ("handshake", "release"):
            return {"error": "expected a handshake or release request"}
        # As bytes: compare_digest refuses non-ASCII str (a TypeError that killed the thread).
        if self._secret is not None and not hmac.compare_digest(
                str(msg.get("secret", "")).encode(), self._secret.encode()):
            return {"error": "wrong or missing side_channel_secret (set the same "
                              "kv_connector_extra_config.side_channel_secret on both sides)",
                    "unauthorized": True}
        if msg["type"] == "release":  # a decode that cannot read gives the blocks back
            if not isinstance(rid := msg.get("request_id"), str):
                return {"error": "release needs a request_id string"}
            self._release(rid)
            return {"ok": True}
        try:
            return {"ok": self._answer()}
        except Exception as e:  # a bug here must not kill the listener
            log.exception("handshake answer failed")
            return {"error": f"handshake failed on the prefill: {e}"}


def handshake(host: str, port: int, timeout_s: float, secret: str | None) -> dict[str, Any]:
    """Ask a prefill rank for its transfer info; HandshakeError with a reason on failure."""
    return _ask(host, port, {"type": "handshake"}, timeout_s, secret)


def release(host: str, port: int, request_id: str, timeout_s: float,
            secret: str | None) -> None:
    """Tell a prefill rank to free a request's blocks without reading them."""
    _ask(host, port, {"type": "release", "request_id": request_id}, timeout_s, secret)


def release_quietly(host: str, port: int, request_id: str, timeout_s: float,
                    secret: str | None) -> None:
    """`release`, best effort: if the prefill cannot be told, its lease frees the blocks."""
    try:
        release(host, port, request_id, timeout_s, secret)
    except HandshakeError as e:
        log.info("request %s: could not release its blocks on %s:%d: %s", request_id, host,
                 port, e)


def _ask(host: str, port: int, msg: dict[str, Any], timeout_s: float,
         secret: str | None) -> Any:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 16 * 2**20)
    try:
        sock.connect(f"tcp://{_bracket(host)}:{port}")
        sock.send_multipart([b"", msgspec.msgpack.encode({**msg, "secret": secret or ""})])
        if not sock.poll(int(timeout_s * 1000)):
            raise HandshakeError(f"no answer from {host}:{port} within {timeout_s}s")
        reply = msgspec.msgpack.decode(sock.recv_multipart()[-1])
    except (zmq.ZMQError, msgspec.DecodeError) as e:
        raise HandshakeError(f"side channel {host}:{port} failed: {e}") from None
    finally:
        sock.close()
    if isinstance(reply, dict) and reply.get("unauthorized"):
        raise SecretRefused(f"{host}:{port} refused: {reply.get('error')}")
    if not isinstance(reply, dict) or "ok" not in reply:
        raise HandshakeError(f"{host}:{port} refused: "
                             f"{reply.get('error') if isinstance(reply, dict) else reply}")
    return reply["ok"]


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
