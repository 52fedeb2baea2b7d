"""The contract between the engine and a KV connector. The engine asks (`on_new_request`),
tells (`start_loads`, `request_finished`) and reads what finished (`poll`); the connector
answers with values and never sees the engine, its scheduler or its block allocator: blocks
it held come back to the engine as `KVConnectorOutput.free_blocks`.

Torch-free: the engine, every connector and their tests share it at no import cost."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.kv_transfer.params import FirstToken, KVParams


@dataclass(slots=True, frozen=True)
class ConnectorContext:
    """What a connector knows of the engine it serves."""
    engine_id: str
    dp_rank: int
    tp_size: int
    block_size: int  # tokens
    block_bytes: int  # of one block on this rank, all layers, K and V
    vocab_size: int
    layer_windows: tuple[int | None, ...] = ()  # each layer's sliding window (ModelConfig)


@dataclass(slots=True)
class RemotePrefill:
    """A new request whose prompt a remote prefill computed."""
    load: bool  # pull its KV (False: too short to be worth a pull; recompute it here)
    first_token: FirstToken | None  # the prefill's first output token, when it sent one


@dataclass(slots=True)
class Load:
    """Blocks the engine gave a request whose KV is to be pulled into them."""
    request_id: str
    block_ids: list[int]
    num_cached_tokens: int  # prompt tokens the local prefix cache already held


@dataclass(slots=True)
class KVConnectorOutput:
    """What changed since the engine last asked; the engine applies it."""
    loaded: list[str] = field(default_factory=list)  # requests whose KV landed
    # Of those, the ones whose sliding layers got only their windows' blocks: their blocks
    # must not serve other requests from the prefix cache.
    windowed: set[str] = field(default_factory=set)
    recompute: list[str] = field(default_factory=list)  # pulls given up: prefill here
    failed: dict[str, str] = field(default_factory=dict)  # request id -> error to report
    free_blocks: list[int] = field(default_factory=list)  # held blocks the engine takes back


class KVConnector(ABC):
    @abstractmethod
    def on_new_request(self, request_id: str, params: KVParams | None,
                       num_prompt_tokens: int) -> RemotePrefill | None:
        """A request arrived; None unless a remote prefill computed its prompt."""

    @abstractmethod
    def start_loads(self, loads: list[Load]) -> KVConnectorOutput:
        """Blocks were allocated for these remote-prefilled requests: pull into them."""

    @abstractmethod
    def request_finished(self, request_id: str, params: KVParams | None, block_ids: list[int],
                         first_token: FirstToken | None) -> tuple[bool, KVParams | None]:
        """A request ended (first_token: the token it produced, if it completed normally).
        Returns whether the connector keeps its blocks (it gives them back through
        `free_blocks` later) and the params to answer the client with."""

    @abstractmethod
    def poll(self) -> KVConnectorOutput: ...

    @abstractmethod
    def busy(self) -> bool:
        """Work only polling advances (pulls, handshakes, leases): keep polling often."""

    @abstractmethod
    def poll_interval(self) -> float:
        """Seconds an idle engine may sleep between polls."""

    @abstractmethod
    def end_leases(self) -> None:
        """The server is going away: give up every held block at the next poll."""

    @abstractmethod
    def info(self) -> list[dict[str, Any]]:
        """What a decode needs to reach each TP rank of this engine."""

    @abstractmethod
    def close(self) -> None: ...


class TPChannel(Protocol):
    """Rank 0's line to its tensor-parallel workers, as KV transfer uses it."""
    worker_infos: list[dict[str, Any]]  # each worker's transport info()

    def send(self, cmd: tuple) -> None:
        """Have every worker run `cmd`."""

    def call(self, cmd: tuple) -> list[Any]:
        """Have every worker run `cmd`; their answers, rank 1 first."""
