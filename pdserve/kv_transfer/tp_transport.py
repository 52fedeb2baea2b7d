"""KV transfer under tensor parallelism: every TP rank has its own NIXL agent and side-channel
port; rank 0's connector drives them all through one Transport.

`TPTransport` (rank 0) does each action on its own rank and broadcasts it to the workers;
`WorkerKV` (each worker) does the same action on its rank and answers when asked. Reads
are posted on every rank at once; rank 0 asks the workers how theirs went only once its
own has landed, and collects their notifications at most every NOTIFS_EVERY seconds."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.interface import TPChannel
from pdserve.kv_transfer.nixl_agent import Xfer
from pdserve.kv_transfer.nixl_transport import NixlTransport
from pdserve.kv_transfer.side_channel import HandshakeError
from pdserve.kv_transfer.transport import IncompatibleKV, Peer, Transport, XferState
from pdserve.model.kv_cache import KVCache
from pdserve.platforms import get_platform

NOTIFS_EVERY = 0.01


@dataclass(slots=True)
class TPXfer:
    id: int
    local: list[Xfer]
    state: XferState = "PROC"  # of the workers' reads, once rank 0's own has landed
    nbytes: int = 0
    descs: int = 0


@dataclass(slots=True)
class TPTransport(Transport):
    local: NixlTransport
    group: TPChannel
    _ids: itertools.count = field(default_factory=itertools.count)
    _last_notifs: float = 0.0

    @property
    def readers(self):
        return self.local.readers

    @property
    def converted(self) -> int:
        return self.local.converted

    def connect(self, host: str, port: int) -> Peer:
        peer = self.local.connect(host, port)
        errors = [e for e in self.group.call(("kv_connect", host, port, peer.info["remote_tp"]))
                  if e is not None]
        if errors:
            self.forget(peer)
            incompatible, why = errors[0]
            raise (IncompatibleKV if incompatible else HandshakeError)(why)
        return peer

    def forget(self, peer: Peer) -> None:
        self.local.forget(peer)
        self.group.send(("kv_forget", peer.host, peer.port))

    def read(self, peer: Peer, local_ids: list[int], remote_ids: list[int],
             notif: bytes, needed_from: list[int] | None = None) -> TPXfer:
        xfer = TPXfer(next(self._ids), self.local.read(peer, local_ids, remote_ids, notif,
                                                       needed_from))
        self.group.send(("kv_read", peer.host, peer.port, xfer.id, local_ids, remote_ids, notif,
                         needed_from))
        return xfer

    def poll(self, handle: TPXfer) -> XferState:
        state = self.local.poll(handle.local)
        if state != "DONE" or handle.state != "PROC":
            return state if state != "DONE" else handle.state
        answers = self.group.call(("kv_poll", handle.id))
        states = {a[0] for a in answers}
        if "ERR" in states or "PROC" not in states:
            handle.state = "ERR" if "ERR" in states else "DONE"
            handle.nbytes, handle.descs = (sum(a[i] for a in answers) for i in (1, 2))
            self.group.send(("kv_drop", handle.id))
        return handle.state

    def handle_stats(self, handle: TPXfer) -> tuple[int, int]:
        nbytes, descs = self.local.handle_stats(handle.local)
        return nbytes + handle.nbytes, descs + handle.descs

    def stage_out(self, block_ids: list[int]) -> None:
        self.local.stage_out(block_ids)
        self.group.call(("kv_stage_out", block_ids))  # done on every rank before the answer

    def notify(self, peer: Peer, msg: bytes) -> None:
        self.local.notify(peer, msg)  # to the prefill's rank 0, which holds the lease

    def notifications(self) -> list[bytes]:
        raw = self.local.raw_notifications()
        if (now := time.monotonic()) - self._last_notifs >= NOTIFS_EVERY:
            self._last_notifs = now
            raw += [m for msgs in self.group.call(("kv_notifs",)) for m in msgs]
        return self.local.readers.feed(raw)

    def release(self, host: str, port: int, request_id: str) -> None:
        self.local.release(host, port, request_id)

    def info(self) -> dict[str, Any]:
        return self.local.info()

    def ranks(self) -> list[dict[str, Any]]:
        return [self.local.info(), *self.group.worker_infos]

    def close(self) -> None:
        self.local.close()


@dataclass(slots=True)
class WorkerKV:
    """A worker rank's transport and the reads rank 0 asked it to post."""
    transport: NixlTransport
    peers: dict[tuple[str, int], Peer] = field(default_factory=dict)
    # a read's handles; None if it failed to post; (state, bytes, descs) once finished
    xfers: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, config: KVTransferConfig, engine_id: str, side_channel: tuple[str, int],
              tp_size: int, tp_rank: int, device: str, cache: KVCache) -> WorkerKV:
        """A worker's KV transfer over its cache shard (`side_channel`: its own port)."""
        return cls(NixlTransport.for_cache(config, engine_id, cache, get_platform(device),
                                           side_channel, tp_size, tp_rank))

    def info(self) -> dict[str, Any]:
        return self.transport.info()

    def handle(self, cmd: tuple, reply: Callable[[Any], None]) -> None:
        """Run one of rank 0's commands; `reply` answers the ones it waits on."""
        kind, *args = cmd
        if kind == "kv_connect":
            reply(self._connect(*args))
        elif kind == "kv_forget":
            if (peer := self.peers.pop((args[0], args[1]), None)) is not None:
                self.transport.forget(peer)
        elif kind == "kv_read":
            self._read(*args)
        elif kind == "kv_poll":
            reply(self._poll(args[0]))
        elif kind == "kv_drop":
            self.xfers.pop(args[0], None)
        elif kind == "kv_stage_out":
            self.transport.stage_out(args[0])
            reply(None)
        elif kind == "kv_notifs":
            reply(self.transport.raw_notifications())

    def _connect(self, host: str, port: int, remote_tp: int) -> tuple[bool, str] | None:
        try:
            self.peers[(host, port)] = self.transport.connect_ranks(host, port, remote_tp)
        except Exception as e:  # rank 0 reports it; this rank keeps serving
            return isinstance(e, IncompatibleKV), f"TP rank {self.transport.tp_rank}: {e}"
        return None

    def _read(self, host: str, port: int, xid: int, local_ids: list[int],
              remote_ids: list[int], notif: bytes, needed_from: list[int] | None) -> None:
        peer = self.peers.get((host, port))
        try:
            self.xfers[xid] = self.transport.read(peer, local_ids, remote_ids, notif,
                                                  needed_from) if peer is not None else None
        except (ValueError, RuntimeError):
            self.xfers[xid] = None

    def _poll(self, xid: int) -> tuple[XferState, int, int]:
        handle = self.xfers.get(xid)
        if handle is None or isinstance(handle, tuple):  # failed to post, or finished
            return handle or ("ERR", 0, 0)
        if (state := self.transport.poll(handle)) == "PROC":
            return state, 0, 0
        self.xfers[xid] = (state, *self.transport.handle_stats(handle))  # until kv_drop
        return self.xfers[xid]

    def close(self) -> None:
        self.transport.close()
