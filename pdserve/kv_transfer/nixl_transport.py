"""The NIXL transport of one engine rank: registers its KV cache (its TP shard) with a NIXL
agent (UCX), answers handshakes on the side channel, and pulls remote blocks with
one-sided READs from the prefill ranks holding the heads it needs, in whatever layout and
block size they have (read_plan)."""

from __future__ import annotations

import hashlib
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer import side_channel
from pdserve.kv_transfer.host_buffer import HostBuffer
from pdserve.kv_transfer.nixl_agent import NixlAgent, Region, TransferError, Xfer
from pdserve.kv_transfer.read_plan import (
    Blocks,
    Geometry,
    ReaderCount,
    Slice,
    check_block_sizes,
    check_layouts,
    check_split,
    num_readers,
    permute_received,
    plan,
    read_descs,
    tag,
)
from pdserve.kv_transfer.side_channel import SideChannelServer, handshake
from pdserve.kv_transfer.transport import DONE, IncompatibleKV, Peer, Transport, XferState
from pdserve.model.kv_cache import KVCache
from pdserve.platforms.base import Platform

PROTOCOL_VERSION = 1
# What both instances must agree on (TP sizes, layouts and block sizes may differ).
_COMPAT_KEYS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "protocol")


@dataclass(slots=True)
class Received:
    """A pull in flight: one READ per source rank, and the blocks they fill."""
    xfers: list[Xfer]
    local_ids: list[int]
    permute: Blocks | None  # the remote blocks' shape, if theirs is not ours
    state: XferState = "PROC"


@dataclass(slots=True)
class Source:
    """A prefill rank this rank reads from, and which of its heads."""
    slice: Slice
    agent: str
    region: Region


class NixlTransport(Transport):
    def __init__(self, engine_id: str, buffer: torch.Tensor, layout: dict[str, Any],
                 host: str, port: int, handshake_timeout: float,
                 secret: str | None = None, serve: bool = True,
                 staging: HostBuffer | None = None) -> None:
        """`buffer`: what NIXL reads and writes, the KV cache or `staging`'s host mirror."""
        self.engine_id = engine_id
        self.staging = staging
        self.layout = {"tp_rank": 0, "tp_size": 1, **layout, "protocol": PROTOCOL_VERSION}
        self.tp_rank, self.tp_size = self.layout["tp_rank"], self.layout["tp_size"]
        self.buffer = buffer
        self.region = Region.from_tensor(buffer, buffer.shape[0])
        self.geometry = Geometry(layout["num_layers"], layout["head_dim"],
                                 buffer.element_size())
        self.blocks = _blocks(self.layout)
        self.converted = 0  # pulls from blocks of another layout or block size
        self.readers = ReaderCount()
        self.agent = NixlAgent(f"{engine_id}-tp{self.tp_rank}-{id(self):x}",
                               gpu=self.region.mem_type == "VRAM")
        self.agent.register(self.region)
        self.host, self.port = host, port
        self.handshake_timeout, self.secret = handshake_timeout, secret
        self._released: list[bytes] = []  # appended by the side-channel thread
        self.server = SideChannelServer(host, port, self._answer, self._on_release,
                                        secret) if serve else None

    @classmethod
    def for_cache(cls, config: KVTransferConfig, engine_id: str, cache: KVCache,
                  platform: Platform, side_channel: tuple[str, int], tp_size: int = 1,
                  tp_rank: int = 0) -> NixlTransport:
        """One rank's transport over its KV shard, or over a host mirror of it."""
        staging = HostBuffer.mirror(platform, cache.tensor) \
            if HostBuffer.needed(config, platform) else None
        s = cache.shape
        layout = {"num_layers": s.num_layers, "num_kv_heads": s.num_kv_heads,
                  "head_dim": s.head_dim, "block_size": s.block_size, "layout": s.layout,
                  "dtype": str(cache.tensor.dtype).removeprefix("torch."),
                  "block_bytes": cache.block_bytes, "tp_size": tp_size, "tp_rank": tp_rank}
        x = config.kv_connector_extra_config
        return cls(engine_id, staging.host if staging else cache.tensor, layout, *side_channel,
                   x.handshake_timeout, x.side_channel_secret, config.is_producer, staging)

    def info(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "tp_rank": self.tp_rank,
                "side_channel_host": self.host, "side_channel_port": self.port}

    def _answer(self) -> dict[str, Any]:
        r = self.region
        return {"engine_id": self.engine_id, "agent_metadata": self.agent.metadata(),
                "base": r.base, "num_blocks": r.num_blocks, "block_bytes": r.block_bytes,
                "mem_type": r.mem_type, "device": r.device, "layout": self.layout,
                "compat_hash": compat_hash(self.layout)}

    def connect(self, host: str, port: int) -> Peer:
        """Handshake with a prefill's TP rank 0 at `port`, then with the other ranks (at
        port + their rank) whose heads this rank needs."""
        first = handshake(host, port, self.handshake_timeout, self.secret)
        remote_tp = first.get("layout", {}).get("tp_size", 1)
        return self.connect_ranks(host, port, remote_tp if isinstance(remote_tp, int) else 0,
                                  first)

    def connect_ranks(self, host: str, port: int, remote_tp: int,
                      first: dict[str, Any] | None = None) -> Peer:
        heads = self.layout["num_kv_heads"] * self.tp_size
        check_split(heads, remote_tp, self.tp_size)
        sources: list[Source] = []
        infos = []
        try:
            for s in plan(heads, remote_tp, self.tp_size, self.tp_rank):
                info = first if s.src == 0 and first is not None else handshake(
                    host, port + s.src, self.handshake_timeout, self.secret)
                self._check_rank(info.get("layout", {}), s.src, remote_tp, host, port)
                infos.append(info)
                sources.append(Source(s, self.agent.add_remote(info["agent_metadata"]), Region(
                    info["base"], info["num_blocks"], info["block_bytes"], info["mem_type"],
                    info["device"])))
        except Exception:
            for src in sources:
                self.agent.remove_remote(src.agent)
            raise
        remote = _blocks(infos[0]["layout"])
        return Peer(host, port, infos[0]["engine_id"], sources[0].agent, infos[0]["num_blocks"],
                    remote.block_size, {"sources": sources, "remote_tp": remote_tp,
                                        "blocks": remote,
                                        "readers": num_readers(heads, remote_tp, self.tp_size)})

    def _check_rank(self, remote: dict[str, Any], rank: int, tp: int, host: str,
                    port: int) -> None:
        check_compatible(self.layout, remote)
        if (remote.get("tp_rank", 0), remote.get("tp_size", 1)) != (rank, tp):
            raise IncompatibleKV(f"{host}:{port + rank} is TP rank {remote.get('tp_rank', 0)}"
                                 f" of {remote.get('tp_size', 1)}, expected rank {rank} of "
                                 f"{tp} (side-channel port = base + dp_rank * TP + tp_rank)")

    def forget(self, peer: Peer) -> None:
        for src in peer.info["sources"]:
            self.agent.remove_remote(src.agent)

    def read(self, peer: Peer, local_ids: list[int], remote_ids: list[int],
             notif: bytes, needed_from: list[int] | None = None) -> Received:
        """`local_ids`: blocks of this rank's size, each taking the next k remote blocks."""
        remote: Blocks = peer.info["blocks"]
        notif = tag(notif, peer.info["readers"])
        xfers = [self._read_source(src, remote, local_ids, remote_ids, notif, needed_from)
                 for src in peer.info["sources"]]
        self.converted += (remote.layout, remote.block_size) != (self.blocks.layout,
                                                                 self.blocks.block_size)
        return Received(xfers, local_ids, remote if remote.layout != self.blocks.layout
                        else None)

    def _read_source(self, src: Source, remote: Blocks, local_ids: list[int],
                     remote_ids: list[int], notif: bytes, needed_from: list[int] | None
                     ) -> Xfer:
        if src.slice.num_heads == self.blocks.heads and remote == self.blocks and \
                needed_from is None:  # alike, whole blocks
            return self.agent.read(self.region, src.region, local_ids, remote_ids, src.agent,
                                   notif)
        k = self.blocks.block_size // remote.block_size
        if -(-len(remote_ids) // k) != len(local_ids):
            raise ValueError(f"{len(remote_ids)} prefill blocks do not fill {len(local_ids)} "
                             f"decode blocks of {k}")
        for region, ids, side in ((self.region, local_ids, "local"),
                                  (src.region, remote_ids, "remote")):
            if ids and not (min(ids) >= 0 and max(ids) < region.num_blocks):
                raise ValueError(f"{side} block id out of range 0..{region.num_blocks - 1}")
        if not local_ids:
            self.agent.notify(src.agent, notif)
            return Xfer(None, 0, 0, state="DONE")
        ldescs, rdescs = read_descs(self.region, src.region, local_ids, remote_ids, src.slice,
                                    self.geometry, self.blocks, remote, needed_from)
        return self.agent.read_descs(ldescs, rdescs, self.region.mem_type,
                                     src.region.mem_type, src.agent, notif)

    def poll(self, handle: Received) -> XferState:
        if handle.state != "PROC":
            return handle.state
        states = {self.agent.poll(x) for x in handle.xfers}
        if "ERR" in states or "PROC" not in states:
            handle.state = "ERR" if "ERR" in states else "DONE"
            if handle.state == "DONE":  # every source landed
                if handle.permute is not None:
                    permute_received(self.buffer, handle.local_ids, self.blocks,
                                     handle.permute)
                if self.staging is not None:
                    self.staging.load(handle.local_ids)
        return handle.state

    def handle_stats(self, handle: Received) -> tuple[int, int]:
        return sum(x.nbytes for x in handle.xfers), sum(x.descs for x in handle.xfers)

    def stage_out(self, block_ids: list[int]) -> None:
        if self.staging is not None:
            self.staging.save(block_ids)

    def notify(self, peer: Peer, msg: bytes) -> None:
        with suppress(TransferError):  # the peer is gone; its lease no longer matters
            self.agent.notify(peer.agent, msg)

    def release(self, host: str, port: int, request_id: str) -> None:
        side_channel.release_quietly(host, port, request_id, self.handshake_timeout,
                                     self.secret)

    def _on_release(self, request_id: str) -> None:
        self._released.append(DONE + request_id.encode())

    def notifications(self) -> list[bytes]:
        return self.readers.feed(self.raw_notifications())

    def raw_notifications(self) -> list[bytes]:
        """Messages as they came, readers' tags and all (a TP rank 0 counts its workers'
        together with its own)."""
        released, self._released = self._released, []
        return released + [msg for _, msg in self.agent.notifications()]

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.agent.close()


def compat_hash(layout: dict[str, Any]) -> str:
    text = ";".join(f"{k}={layout.get(k)}" for k in _COMPAT_KEYS)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _blocks(layout: dict[str, Any]) -> Blocks:
    return Blocks(layout.get("layout"), layout.get("num_kv_heads"), layout.get("block_size"))


def _whole(layout: dict[str, Any]) -> dict[str, Any]:
    """A rank's layout as the whole instance's: TP ranks differ only in their head shares."""
    tp = layout.get("tp_size", 1)
    if not isinstance(tp, int) or tp == 1:
        return layout
    return {**layout, "num_kv_heads": layout.get("num_kv_heads", 0) * tp}


def check_compatible(local: dict[str, Any], remote: dict[str, Any]) -> None:
    """Refuse a prefill whose blocks cannot be read into ours, naming every difference;
    TP sizes, layouts and block sizes that can be converted pass."""
    whole_local, whole_remote = _whole(local), _whole(remote)
    diffs = [f"{k}: prefill {whole_remote.get(k)!r}, decode {whole_local.get(k)!r}"
             for k in _COMPAT_KEYS if whole_local.get(k) != whole_remote.get(k)]
    if diffs:
        raise IncompatibleKV("prefill and decode KV caches are incompatible (" +
                             "; ".join(diffs) + "); start both with the same model, "
                             "--dtype and --kv-cache-dtype")
    check_layouts(remote.get("tp_size", 1), local.get("tp_size", 1), remote.get("layout"),
                  local.get("layout"))
    rbs = remote.get("block_size")
    if not isinstance(rbs, int) or rbs < 1:
        raise IncompatibleKV(f"the prefill's block size {rbs!r} is not a positive integer")
    check_block_sizes(rbs, local["block_size"])
