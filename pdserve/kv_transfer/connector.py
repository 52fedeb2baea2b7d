"""The scheduler side of P/D: which requests pull KV and from where, leases on blocks a
prefill holds, heartbeats, failure policy. Runs on the engine thread; handshakes (blocking
network I/O) run on a helper thread and are picked up by poll()."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.config import KVTransferConfig
from pdserve.engine.request import Request, RequestOutput, Status, TopLogprobs
from pdserve.kv_transfer.base import DONE, RENEW, Misconfigured, Peer, Transport
from pdserve.kv_transfer.host_buffer import HostBuffer
from pdserve.kv_transfer.lease import LeaseTable
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.kv_transfer.params import ParamsValidator, complete

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine

log = logging.getLogger("pdserve.kv_transfer")
# Fault injection for tests, off unless set: the decode waits this long (blocking its engine
# thread) between the handshake and posting a READ, a window to kill the prefill mid-pull.
FAULT_TRANSFER_DELAY_S = float(os.environ.get("PDSERVE_FAULT_TRANSFER_DELAY_S") or 0)
# How long the engine waits for a READ it just posted before stepping without it: longer
# than a pull on one host takes, short against a decode step the running requests wait on.
READ_WAIT_S = 0.002


@dataclass(slots=True)
class Pull:
    """A decode request's remote KV: where it is, and how far the pull got."""
    req: Request
    host: str
    port: int
    engine_id: str
    block_ids: list[int]
    request_id: str  # the prefill's id for it
    has_first_token: bool
    peer: Peer | None = None
    handle: Any = None
    started: float = 0.0
    deadline: float = 0.0
    renewed: float = field(default_factory=time.monotonic)
    abandoned: bool = False  # the request ended; only tell the prefill and clean up


class PDConnector:
    def __init__(self, config: KVTransferConfig, engine: LLMEngine, transport: Transport,
                 metrics: TransferMetrics, side_channel_host: str,
                 staging: HostBuffer | None = None) -> None:
        self.config = config
        self.x = config.kv_connector_extra_config
        self.engine = engine
        self.transport = transport
        self.metrics = metrics
        self.staging = staging  # host buffer NIXL reads from, when the KV lives elsewhere
        self.leases = LeaseTable(self.x.kv_lease_duration)
        self.pulls: dict[str, Pull] = {}
        self.peers: dict[tuple[str, int], Peer] = {}
        self.connecting: dict[tuple[str, int], Future] = {}
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kv-handshake")
        self.validate_params = ParamsValidator(
            engine.config.block_size, engine.tokenizer.vocab_size,
            frozenset({side_channel_host, *self.x.allowed_remote_hosts}), config.is_consumer)
        self._last_log = 0.0
        self._last_sent = 0.0

    # -- engine hooks (engine thread) -------------------------------------------------------

    def on_add(self, req: Request) -> tuple[int, float, TopLogprobs] | None:
        """Note a remote-prefilled request; returns the prefill's first token to emit now."""
        p = req.kv_transfer_params or {}
        if not (p.get("do_remote_prefill") and self.config.is_consumer and complete(p)):
            return None
        first = p.get("first_token_id")
        pull = Pull(req, p["remote_host"], p["remote_port"], p["remote_engine_id"],
                    list(p["remote_block_ids"]), p.get("remote_request_id") or req.request_id,
                    first is not None)
        self.pulls[req.request_id] = pull
        self._connect(pull)  # early, so the handshake overlaps the wait for blocks
        if req.num_prompt_tokens >= max(self.x.min_transfer_tokens, 1):
            req.load_remote = True
        else:
            self.metrics.recomputed.inc()
            pull.abandoned = True  # recompute here; tell the prefill to let go
        if first is None:
            return None
        top = [(int(t), float(lp)) for t, lp in p.get("first_token_top_logprobs") or []]
        return int(first), float(p.get("first_token_logprob") or 0.0), top

    def start_load(self, reqs: list[Request]) -> list[RequestOutput]:
        """Post the READs of requests just given blocks, and wait a moment for them: on one
        host a READ lands in well under a millisecond, and its request then runs in the
        step about to start instead of a whole step later."""
        outputs: list[RequestOutput] = []
        started = [p for r in reqs if (p := self.pulls[r.request_id]).peer is not None]
        for pull in started:
            self._start_read(pull, outputs)
        deadline = time.monotonic() + READ_WAIT_S
        while (reading := [p for p in started if p.handle is not None]) and \
                time.monotonic() < deadline:
            time.sleep(READ_WAIT_S / 20)  # the core goes to NIXL's progress thread
            now = time.monotonic()
            for pull in reading:
                self._check_read(pull, now, outputs)
        return outputs

    def on_finish(self, req: Request, was_loading: bool) -> bool:
        """A request ended. True if the connector keeps its blocks (and frees them later)."""
        pull = self.pulls.get(req.request_id)
        if pull is not None:
            pull.abandoned = True
            return pull.handle is not None  # a READ may still be writing the blocks
        p = req.kv_transfer_params or {}
        if p.get("do_remote_decode") and self.config.is_producer and \
                req.finish_reason in ("stop", "length") and req.num_output_tokens > 0:
            self._hold_for_decode(req)
            return True
        return False

    def busy(self) -> bool:
        """Work only polling can advance (the engine loop then polls often)."""
        return bool(self.pulls or self.connecting or self.leases.leases)

    def poll_interval(self) -> float:
        return 0.001 if self.pulls else 0.01 if self.leases.leases else 0.05

    def poll(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        self._handle_notifications()
        self._expire_leases()
        self._collect_handshakes(outputs)
        now = time.monotonic()
        for pull in list(self.pulls.values()):
            if pull.handle is not None:
                self._check_read(pull, now, outputs)
            elif pull.abandoned and pull.peer is not None:
                self.transport.notify(pull.peer, DONE + pull.request_id.encode())
                del self.pulls[pull.req.request_id]
            elif pull.peer is not None and now - pull.renewed > self.x.kv_lease_duration / 3:
                self.transport.notify(pull.peer, RENEW + pull.request_id.encode())
                pull.renewed = now
        self.metrics.blocks_held.set(self.leases.num_blocks)
        self._log_stats(now)
        return outputs

    def info(self) -> list[dict[str, Any]]:
        return [{"tp_rank": 0, **r, "dp_rank": self.engine.dp_rank}
                for r in self.transport.ranks()]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()

    # -- prefill side ----------------------------------------------------------------------

    def _hold_for_decode(self, req: Request) -> None:
        info = self.transport.info()
        if self.staging is not None:  # decodes read the host copy
            self.staging.save(req.block_ids)
        self.leases.hold(req.request_id, list(req.block_ids))
        req.response_kv_params = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": info["engine_id"], "remote_block_ids": list(req.block_ids),
            "remote_request_id": req.request_id, "remote_host": info["side_channel_host"],
            "remote_port": info["side_channel_port"],
            "tp_size": self.engine.config.tensor_parallel_size,
            "first_token_id": req.output_token_ids[0],
            "first_token_logprob": req.output_logprobs[0],
        }
        if req.output_top_logprobs:  # asked for: the decode emits them with the first token
            req.response_kv_params["first_token_top_logprobs"] = [
                [t, lp] for t, lp in req.output_top_logprobs[0]]

    def end_leases(self) -> None:
        """The server is going away: end every lease now (the next poll frees the blocks)."""
        for lease in self.leases.leases.values():
            lease.deadline = 0.0

    def _handle_notifications(self) -> None:
        for msg in self.transport.notifications():
            if msg.startswith(DONE):
                self._free(self.leases.reader_done(msg[len(DONE):].decode(errors="replace")))
            elif msg.startswith(RENEW):
                self.leases.renew(msg[len(RENEW):].decode(errors="replace"))

    def _expire_leases(self) -> None:
        for rid, blocks in self.leases.expire():
            log.warning("request %s: lease on %d blocks expired: no decode read them", rid,
                        len(blocks))
            self.metrics.lease_expired.inc()
            self._free(blocks)

    def _free(self, blocks: list[int]) -> None:
        if blocks:
            self.engine.allocator.free(blocks)

    # -- decode side -----------------------------------------------------------------------

    def _connect(self, pull: Pull) -> None:
        key = (pull.host, pull.port)
        peer = self.peers.get(key)
        if peer is not None and peer.engine_id != pull.engine_id:
            # The prefill restarted (a new engine and agent): never read via the stale one.
            self.transport.forget(peer)
            del self.peers[key]
            peer = None
        if peer is not None:
            pull.peer = peer
        elif key not in self.connecting:
            self.connecting[key] = self._pool.submit(self.transport.connect, *key)

    def _collect_handshakes(self, outputs: list[RequestOutput]) -> None:
        for key, fut in list(self.connecting.items()):
            if not fut.done():
                continue
            del self.connecting[key]
            try:
                peer = fut.result()
            except Exception as e:  # handshake refused, timed out, or incompatible
                # A misconfigured pair is an error to report, whatever the policy.
                self._fail_pulls(key, f"KV handshake with {key[0]}:{key[1]} failed: {e}",
                                 outputs, force=isinstance(e, Misconfigured))
                continue
            self.peers[key] = peer
            for pull in [p for p in self.pulls.values() if (p.host, p.port) == key]:
                if pull.engine_id != peer.engine_id:
                    self._fail(pull, f"unknown remote_engine_id {pull.engine_id!r}: "
                                     f"{key[0]}:{key[1]} is engine {peer.engine_id!r}",
                               outputs)
                    continue
                pull.peer = peer
                if pull.req.status is Status.WAITING_FOR_REMOTE_KV:
                    self._start_read(pull, outputs)

    def _start_read(self, pull: Pull, outputs: list[RequestOutput]) -> None:
        # Blocks the local prefix cache already held are not pulled again.
        skip = self._num_cached_blocks(pull)
        self.metrics.bytes_saved.inc(skip * self.engine.cache.block_bytes)
        if skip == len(pull.block_ids):  # all of it: only tell the prefill to let go
            self.transport.notify(pull.peer, DONE + pull.request_id.encode())
            del self.pulls[pull.req.request_id]
            self._loaded(pull)
            return
        local = pull.req.block_ids[skip:len(pull.block_ids)]
        if FAULT_TRANSFER_DELAY_S:
            log.warning("request %s: fault injection: holding its KV READ for %gs",
                        pull.req.request_id, FAULT_TRANSFER_DELAY_S)
            time.sleep(FAULT_TRANSFER_DELAY_S)
        try:
            pull.handle = self.transport.read(pull.peer, local, pull.block_ids[skip:],
                                              DONE + pull.request_id.encode())
        except (ValueError, RuntimeError) as e:
            pull.handle = None
            self._fail(pull, f"KV read from {pull.host}:{pull.port} refused: {e}", outputs)
            return
        pull.started = time.monotonic()
        pull.deadline = pull.started + self.x.transfer_timeout

    def _check_read(self, pull: Pull, now: float, outputs: list[RequestOutput]) -> None:
        state = self.transport.poll(pull.handle)
        if state == "PROC" and now < pull.deadline:
            return
        handle, pull.handle = pull.handle, None
        if state != "DONE":
            why = "timed out" if state == "PROC" else "failed (prefill gone?)"
            self._fail(pull, f"KV read from {pull.host}:{pull.port} {why}", outputs)
            return
        nbytes, descs = self.transport.handle_stats(handle)
        self.metrics.transfers.inc()
        self.metrics.bytes.inc(nbytes)
        self.metrics.descriptors.observe(descs)
        self.metrics.seconds.observe(now - pull.started)
        del self.pulls[pull.req.request_id]
        if pull.abandoned:  # the request ended while its blocks were being written
            self.engine.free_blocks(pull.req)
            return
        if self.staging is not None:
            self.staging.load(pull.req.block_ids[self._num_cached_blocks(pull):
                                                 len(pull.block_ids)])
        self._loaded(pull)

    def _num_cached_blocks(self, pull: Pull) -> int:
        return min(pull.req.num_cached_tokens // self.engine.config.block_size,
                   len(pull.block_ids))

    def _loaded(self, pull: Pull) -> None:
        self.engine.scheduler.loaded(pull.req, ok=True, recompute_last=not pull.has_first_token)

    def _fail_pulls(self, key: tuple[str, int], why: str, outputs: list[RequestOutput],
                    force: bool = False) -> None:
        for pull in [p for p in self.pulls.values() if (p.host, p.port) == key]:
            self._fail(pull, why, outputs, force)

    def _fail(self, pull: Pull, why: str, outputs: list[RequestOutput],
              force: bool = False) -> None:
        """Apply kv_load_failure_policy to a pull that cannot complete."""
        self.pulls.pop(pull.req.request_id, None)
        if pull.peer is not None:
            self.transport.notify(pull.peer, DONE + pull.request_id.encode())
        else:  # no NIXL peer (refused handshake): give the blocks back over the side channel
            self._pool.submit(self._release, pull)
        req = pull.req
        if pull.abandoned:
            if req.finished and req.block_ids:  # blocks were kept for the failed READ
                self.engine.free_blocks(req)
            return
        self.metrics.failures.inc()
        log.warning("request %s: %s", req.request_id, why)
        if force or self.config.kv_load_failure_policy == "fail":
            outputs.append(self.engine.fail_request(req, why))
            return
        self.metrics.recomputed.inc()
        if req.status is Status.WAITING_FOR_REMOTE_KV:
            self.engine.scheduler.loaded(req, ok=False)
        req.load_remote = False

    def _release(self, pull: Pull) -> None:
        try:
            self.transport.release(pull.host, pull.port, pull.request_id)
        except Exception as e:  # best effort: the prefill's lease frees them anyway
            log.info("request %s: could not release its blocks on %s:%d: %s",
                     pull.request_id, pull.host, pull.port, e)

    def _log_stats(self, now: float) -> None:
        if now - self._last_log < 10:
            return
        self._last_log = now
        sent = self.metrics.transfers._value.get()
        if sent != self._last_sent or self.leases.leases:  # only while transfers happen
            self._last_sent = sent
            log.info("KV transfer: %d pulls, %.1f MB, %d failures, %d blocks held, "
                     "%d leases expired", sent, self.metrics.bytes._value.get() / 1e6,
                     self.metrics.failures._value.get(), self.leases.num_blocks,
                     self.metrics.lease_expired._value.get())

