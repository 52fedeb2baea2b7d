"""The NIXL transport: registers the KV cache with a NIXL agent (UCX), answers handshakes
on the side channel, and pulls remote blocks with one-sided READs."""

from __future__ import annotations

import hashlib
from contextlib import suppress
from typing import Any

import torch

from pdserve.kv_transfer import side_channel
from pdserve.kv_transfer.base import DONE, IncompatibleKV, Peer, Transport, XferState
from pdserve.kv_transfer.nixl_agent import NixlAgent, Region, TransferError, Xfer
from pdserve.kv_transfer.side_channel import SideChannelServer, handshake

PROTOCOL_VERSION = 1
# What both sides' blocks must agree on for a byte-for-byte read.
_COMPAT_KEYS = ("num_layers", "num_kv_heads", "head_dim", "block_size", "layout", "dtype",
                "block_bytes")


class NixlTransport(Transport):
    def __init__(self, engine_id: str, buffer: torch.Tensor, layout: dict[str, Any],
                 host: str, port: int, handshake_timeout: float,
                 secret: str | None = None, serve: bool = True) -> None:
        self.engine_id = engine_id
        self.layout = {**layout, "protocol": PROTOCOL_VERSION}
        self.region = Region.from_tensor(buffer, buffer.shape[0])
        self.agent = NixlAgent(f"{engine_id}-{id(self):x}", gpu=self.region.mem_type == "VRAM")
        self.agent.register(self.region)
        self.host, self.port = host, port
        self.handshake_timeout, self.secret = handshake_timeout, secret
        self._released: list[bytes] = []  # appended by the side-channel thread
        self.server = SideChannelServer(host, port, self._answer, self._on_release,
                                        secret) if serve else None

    def info(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "side_channel_host": self.host,
                "side_channel_port": self.port}

    def _answer(self) -> dict[str, Any]:
        r = self.region
        return {"engine_id": self.engine_id, "agent_metadata": self.agent.metadata(),
                "base": r.base, "num_blocks": r.num_blocks, "block_bytes": r.block_bytes,
                "mem_type": r.mem_type, "device": r.device, "layout": self.layout,
                "compat_hash": compat_hash(self.layout)}

    def connect(self, host: str, port: int) -> Peer:
        info = handshake(host, port, self.handshake_timeout, self.secret)
        check_compatible(self.layout, info.get("layout", {}))
        agent = self.agent.add_remote(info["agent_metadata"])
        return Peer(host, port, info["engine_id"], agent, info["num_blocks"], {
            "region": Region(info["base"], info["num_blocks"], info["block_bytes"],
                             info["mem_type"], info["device"])})

    def forget(self, peer: Peer) -> None:
        self.agent.remove_remote(peer.agent)

    def read(self, peer: Peer, local_ids: list[int], remote_ids: list[int],
             notif: bytes) -> Xfer:
        return self.agent.read(self.region, peer.info["region"], local_ids, remote_ids,
                               peer.agent, notif)

    def poll(self, handle: Xfer) -> XferState:
        return self.agent.poll(handle)

    def handle_stats(self, handle: Xfer) -> tuple[int, int]:
        return handle.nbytes, handle.descs

    def notify(self, peer: Peer, msg: bytes) -> None:
        with suppress(TransferError):  # the peer is gone; its lease no longer matters
            self.agent.notify(peer.agent, msg)

    def release(self, host: str, port: int, request_id: str) -> None:
        side_channel.release(host, port, request_id, self.handshake_timeout, self.secret)

    def _on_release(self, request_id: str) -> None:
        self._released.append(DONE + request_id.encode())

    def notifications(self) -> list[bytes]:
        released, self._released = self._released, []
        return released + [msg for _, msg in self.agent.notifications()]

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.agent.close()


def compat_hash(layout: dict[str, Any]) -> str:
    text = ";".join(f"{k}={layout.get(k)}" for k in (*_COMPAT_KEYS, "protocol"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_compatible(local: dict[str, Any], remote: dict[str, Any]) -> None:
    """Refuse a peer whose blocks differ from ours, naming every difference."""
    if compat_hash(local) == compat_hash(remote):
        return
    diffs = [f"{k}: prefill {remote.get(k)!r}, decode {local.get(k)!r}"
             for k in (*_COMPAT_KEYS, "protocol") if local.get(k) != remote.get(k)]
    raise IncompatibleKV("prefill and decode KV caches are incompatible (" +
                         "; ".join(diffs) + "); start both with the same model, --dtype, "
                         "--block-size and --kv-layout")
