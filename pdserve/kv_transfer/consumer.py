"""The decode side of P/D: pulls a remote prefill's KV into the blocks the engine gave a
request. Handshakes (blocking network I/O) run on a helper thread; READs are polled. A pull
that cannot complete is recomputed here or failed, as kv_load_failure_policy says."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.interface import ConnectorContext, KVConnectorOutput, Load, RemotePrefill
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.kv_transfer.params import KVParams
from pdserve.kv_transfer.read_plan import needed_from
from pdserve.kv_transfer.transport import DONE, RENEW, Misconfigured, Peer, Transport

log = logging.getLogger("pdserve.kv_transfer")
# Fault injection for tests, off unless set: the decode waits this long (blocking its engine
# thread) between the handshake and posting a READ, a window to kill the prefill mid-pull.
FAULT_TRANSFER_DELAY_S = float(os.environ.get("PDSERVE_FAULT_TRANSFER_DELAY_S") or 0)
# How long the engine waits for a READ it just posted before stepping without it: longer
# than a pull on one host takes, short against a decode step the running requests wait on.
READ_WAIT_S = 0.002


@dataclass(slots=True)
class Pull:
    """A request's remote KV: where it is, where it goes, and how far the pull got."""
    request_id: str
    host: str
    port: int
    engine_id: str
    remote_ids: list[int]
    remote_request_id: str  # the prefill's id for it
    num_tokens: int  # of the prompt
    block_ids: list[int] | None = None  # the request's blocks, once the engine gave them
    cached_tokens: int = 0  # leading tokens the local prefix cache already held
    local_ids: list[int] = field(default_factory=list)  # the blocks being pulled into
    peer: Peer | None = None
    handle: Any = None
    started: float = 0.0
    deadline: float = 0.0
    renewed: float = field(default_factory=time.monotonic)
    abandoned: bool = False  # the request ended, or recomputes: only tell the prefill
    held: list[int] = field(default_factory=list)  # an ended request's blocks a READ writes
    needed_from: list[int] | None = None  # per layer, the first token read (read_plan)

    @property
    def key(self) -> tuple[str, int]:
        return self.host, self.port

    def message(self, kind: bytes) -> bytes:
        return kind + self.remote_request_id.encode()


class Consumer:
    def __init__(self, config: KVTransferConfig, ctx: ConnectorContext, transport: Transport,
                 metrics: TransferMetrics) -> None:
        self.x = config.kv_connector_extra_config
        self.fail_by_policy = config.kv_load_failure_policy == "fail"
        self.ctx, self.transport, self.metrics = ctx, transport, metrics
        self.pulls: dict[str, Pull] = {}
        self.peers: dict[tuple[str, int], Peer] = {}
        self.connecting: dict[tuple[str, int], Future] = {}
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kv-handshake")

    def on_new_request(self, request_id: str, p: KVParams,
                       num_prompt_tokens: int) -> RemotePrefill:
        pull = Pull(request_id, p.remote_host, p.remote_port, p.remote_engine_id,
                    list(p.remote_block_ids), p.remote_request_id or request_id,
                    num_prompt_tokens)
        self.pulls[request_id] = pull
        self._connect(pull)  # early, so the handshake overlaps the wait for blocks
        load = num_prompt_tokens >= max(self.x.min_transfer_tokens, 1)
        if not load:
            self.metrics.recomputed.inc()
            pull.abandoned = True  # recompute here; tell the prefill to let go
        return RemotePrefill(load, p.first_token)

    def start_loads(self, loads: list[Load], out: KVConnectorOutput) -> None:
        """Post the READs, and wait a moment for them: on one host a READ lands in well
        under a millisecond, and its request then runs in the step about to start instead
        of a whole step later."""
        started = []
        for load in loads:
            if (pull := self.pulls.get(load.request_id)) is None:  # given up meanwhile
                out.recompute.append(load.request_id)
                continue
            pull.block_ids, pull.cached_tokens = load.block_ids, load.num_cached_tokens
            if pull.peer is not None:
                started.append(pull)
        for pull in started:
            self._start_read(pull, out)
        deadline = time.monotonic() + READ_WAIT_S
        while (reading := [p for p in started if p.handle is not None]) and \
                time.monotonic() < deadline:
            time.sleep(READ_WAIT_S / 20)  # the core goes to NIXL's progress thread
            now = time.monotonic()
            for pull in reading:
                self._check_read(pull, now, out)

    def finished(self, request_id: str, block_ids: list[int]) -> bool:
        """A request ended; True if its blocks stay here until a READ into them ends."""
        pull = self.pulls.get(request_id)
        if pull is None:
            return False
        pull.abandoned = True
        if pull.handle is None:
            return False
        pull.held = list(block_ids)
        return True

    def poll(self, out: KVConnectorOutput) -> None:
        self._collect_handshakes(out)
        now = time.monotonic()
        for pull in list(self.pulls.values()):
            if pull.handle is not None:
                self._check_read(pull, now, out)
            elif pull.abandoned and pull.peer is not None:
                self.transport.notify(pull.peer, pull.message(DONE))
                del self.pulls[pull.request_id]
            elif pull.peer is not None and now - pull.renewed > self.x.kv_lease_duration / 3:
                self.transport.notify(pull.peer, pull.message(RENEW))
                pull.renewed = now

    def busy(self) -> bool:
        return bool(self.pulls or self.connecting)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _connect(self, pull: Pull) -> None:
        peer = self.peers.get(pull.key)
        if peer is not None and peer.engine_id != pull.engine_id:
            # The prefill restarted (a new engine and agent): never read via the stale one.
            self.transport.forget(peer)
            del self.peers[pull.key]
            peer = None
        if peer is not None:
            pull.peer = peer
        elif pull.key not in self.connecting:
            self.connecting[pull.key] = self._pool.submit(self.transport.connect, *pull.key)

    def _drop_peer(self, pull: Pull) -> None:
        """Forget the peer of a pull whose READ failed or stalled: the prefill died, and one
        started again at its address (a supervisor's restart: same engine id, a new agent)
        is handshaken afresh by the next request, instead of every pull failing on the
        stale agent. The failed pull's release then goes over the side channel, to whoever
        serves there now."""
        peer, pull.peer = pull.peer, None
        if self.peers.get(pull.key) is peer:
            del self.peers[pull.key]
            self.transport.forget(peer)

    def _collect_handshakes(self, out: KVConnectorOutput) -> None:
        for key, fut in list(self.connecting.items()):
            if not fut.done():
                continue
            del self.connecting[key]
            try:
                peer = fut.result()
            except Exception as e:  # handshake refused, timed out, or incompatible
                # A misconfigured pair is an error to report, whatever the policy.
                for pull in self._pulls_from(key):
                    self._fail(pull, f"KV handshake with {key[0]}:{key[1]} failed: {e}", out,
                               force=isinstance(e, Misconfigured))
                continue
            self.peers[key] = peer
            for pull in self._pulls_from(key):
                if pull.engine_id != peer.engine_id:
                    self._fail(pull, f"unknown remote_engine_id {pull.engine_id!r}: "
                                     f"{key[0]}:{key[1]} is engine {peer.engine_id!r}", out)
                    continue
                pull.peer = peer
                if pull.block_ids is not None and not pull.abandoned:  # blocks are waiting
                    self._start_read(pull, out)

    def _pulls_from(self, key: tuple[str, int]) -> list[Pull]:
        return [p for p in self.pulls.values() if p.key == key]

    def _start_read(self, pull: Pull, out: KVConnectorOutput) -> None:
        # A local block takes k of the prefill's. Those the local prefix cache already held
        # are not pulled again.
        b = pull.peer.block_size
        if len(pull.remote_ids) != -(-pull.num_tokens // b):
            self._fail(pull, f"remote_block_ids has {len(pull.remote_ids)} blocks, but the "
                             f"prefill's blocks of {b} tokens hold {pull.num_tokens} in "
                             f"{-(-pull.num_tokens // b)}", out)
            return
        k = self.ctx.block_size // b
        needed = -(-len(pull.remote_ids) // k)
        skip = min(pull.cached_tokens // self.ctx.block_size, needed)
        self.metrics.bytes_saved.inc(skip * self.ctx.block_bytes)
        if skip == needed:  # all of it: only tell the prefill to let go
            self.transport.notify(pull.peer, pull.message(DONE))
            del self.pulls[pull.request_id]
            out.loaded.append(pull.request_id)
            return
        if FAULT_TRANSFER_DELAY_S:
            log.warning("request %s: fault injection: holding its KV READ for %gs",
                        pull.request_id, FAULT_TRANSFER_DELAY_S)
            time.sleep(FAULT_TRANSFER_DELAY_S)
        pull.local_ids = pull.block_ids[skip:needed]
        # Sliding layers: only the blocks their windows still see.
        pull.needed_from = needed_from(self.ctx.layer_windows, pull.num_tokens, skip * k * b)
        try:
            pull.handle = self.transport.read(pull.peer, pull.local_ids,
                                              pull.remote_ids[skip * k:], pull.message(DONE),
                                              pull.needed_from)
        except (ValueError, RuntimeError) as e:
            pull.handle = None
            self._drop_peer(pull)
            self._fail(pull, f"KV read from {pull.host}:{pull.port} refused: {e}", out)
            return
        pull.started = time.monotonic()
        pull.deadline = pull.started + self.x.transfer_timeout
        if pull.needed_from is not None:
            self.metrics.bytes_saved.inc(self._unread_bytes(pull, len(pull.remote_ids) - skip * k,
                                                            k))

    def _unread_bytes(self, pull: Pull, n: int, k: int) -> int:
        """This rank's bytes of sliding layers' K/V that a windowed pull of n remote blocks
        (k to a local one) leaves unread."""
        per_layer = self.ctx.block_bytes // len(self.ctx.layer_windows) // k
        return per_layer * sum(min(n, first // pull.peer.block_size)
                               for first in pull.needed_from)

    def _check_read(self, pull: Pull, now: float, out: KVConnectorOutput) -> None:
        state = self.transport.poll(pull.handle)
        if state == "PROC" and now < pull.deadline:
            return
        handle, pull.handle = pull.handle, None
        if state != "DONE":
            why = "timed out" if state == "PROC" else "failed (prefill gone?)"
            self._drop_peer(pull)
            self._fail(pull, f"KV read from {pull.host}:{pull.port} {why}", out)
            return
        self.metrics.pulled(*self.transport.handle_stats(handle), now - pull.started)
        del self.pulls[pull.request_id]
        if pull.abandoned:  # the request ended while its blocks were being written
            out.free_blocks += pull.held
            return
        out.loaded.append(pull.request_id)
        if pull.needed_from is not None:
            out.windowed.add(pull.request_id)

    def _fail(self, pull: Pull, why: str, out: KVConnectorOutput, force: bool = False) -> None:
        """Apply kv_load_failure_policy to a pull that cannot complete."""
        self.pulls.pop(pull.request_id, None)
        if pull.peer is not None:
            self.transport.notify(pull.peer, pull.message(DONE))
        else:  # no NIXL peer (refused handshake, failed READ): the side channel tells it
            self._pool.submit(self.transport.release, pull.host, pull.port,
                              pull.remote_request_id)
        if pull.abandoned:
            out.free_blocks += pull.held  # kept for the failed READ, if any
            return
        self.metrics.failed()
        log.warning("request %s: %s", pull.request_id, why)
        if force or self.fail_by_policy:
            out.failed[pull.request_id] = why
        else:
            self.metrics.recomputed.inc()
            out.recompute.append(pull.request_id)
