"""What moves KV bytes between engines: memory registration, handshakes, one-sided reads,
notifications. `PDConnector` (connector.py) keeps the books over any Transport; a second
way to move bytes (push/WRITE, shared memory) is a new Transport."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

XferState = Literal["DONE", "PROC", "ERR"]
# Notifications a decode sends a prefill, followed by the prefill's request id.
DONE, RENEW = b"done:", b"renew:"


class Misconfigured(RuntimeError):
    """The two sides refuse each other until a person fixes their configuration: retrying
    or recomputing would hide it, so the client gets the error whatever the policy."""


class IncompatibleKV(Misconfigured):
    """The two sides' KV layouts cannot be read into each other; the message says how."""


@dataclass(slots=True)
class Peer:
    """A remote rank after a successful handshake."""
    host: str
    port: int
    engine_id: str
    agent: str
    num_blocks: int
    block_size: int  # tokens: a multiple of it fills one of our blocks
    info: dict[str, Any]  # the rest of what the handshake told us


class Transport(ABC):
    @abstractmethod
    def connect(self, host: str, port: int) -> Peer:
        """Handshake with a remote rank (blocking; called off the engine thread)."""

    @abstractmethod
    def forget(self, peer: Peer) -> None:
        """Drop a peer (e.g. it restarted with a new agent)."""

    @abstractmethod
    def read(self, peer: Peer, local_ids: list[int], remote_ids: list[int],
             notif: bytes, needed_from: list[int] | None = None) -> Any:
        """Start pulling remote blocks into local ones (each local block takes the next
        local_block_size / peer.block_size remote ones); `notif` reaches the peer when
        done. `needed_from`: per layer, the first token (of those read) still seen; a
        sliding layer's blocks before it are not read (read_plan.needed_from)."""

    @abstractmethod
    def poll(self, handle: Any) -> XferState: ...

    @abstractmethod
    def handle_stats(self, handle: Any) -> tuple[int, int]:
        """(bytes, descriptors) of a read."""

    @abstractmethod
    def stage_out(self, block_ids: list[int]) -> None:
        """Make a finished prompt's blocks readable by decodes (a host mirror copies them
        out of the device; reading the cache itself needs nothing)."""

    @abstractmethod
    def notify(self, peer: Peer, msg: bytes) -> None: ...

    @abstractmethod
    def notifications(self) -> list[bytes]: ...

    @abstractmethod
    def release(self, host: str, port: int, request_id: str) -> None:
        """Ask a prefill to free a request's blocks without a peer (blocking; off the engine
        thread). Best effort: a failure is logged, and the prefill's lease frees them."""

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """What a decode needs to reach this rank: engine_id, host, port."""

    def ranks(self) -> list[dict[str, Any]]:
        """info() of every TP rank of this engine (each has its own agent and port)."""
        return [self.info()]

    @abstractmethod
    def close(self) -> None: ...
