"""The prefill side of P/D: the blocks of a finished prompt stay held under a lease until its
decode has read them (or the lease runs out), and the answer tells the decode where they are."""

from __future__ import annotations

import logging

from pdserve.kv_transfer.interface import ConnectorContext, KVConnectorOutput
from pdserve.kv_transfer.lease import LeaseTable
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.kv_transfer.params import FirstToken, KVParams
from pdserve.kv_transfer.transport import DONE, RENEW, Transport

log = logging.getLogger("pdserve.kv_transfer")


class Producer:
    def __init__(self, ctx: ConnectorContext, transport: Transport, metrics: TransferMetrics,
                 lease_duration: float) -> None:
        self.ctx, self.transport, self.metrics = ctx, transport, metrics
        self.leases = LeaseTable(lease_duration)

    def hold(self, request_id: str, block_ids: list[int], first: FirstToken) -> KVParams:
        """Keep a finished prompt's blocks for its decode; the params that point to them."""
        self.transport.stage_out(block_ids)  # before any decode can know of them
        self.leases.hold(request_id, list(block_ids))
        info = self.transport.info()
        return KVParams.for_decode(info["engine_id"], info["side_channel_host"],
                                   info["side_channel_port"], request_id, block_ids,
                                   self.ctx.tp_size, first)

    def poll(self, out: KVConnectorOutput) -> None:
        for msg in self.transport.notifications():
            if msg.startswith(DONE):
                rid = msg[len(DONE):].decode(errors="replace")
                out.free_blocks += self.leases.reader_done(rid)
            elif msg.startswith(RENEW):
                self.leases.renew(msg[len(RENEW):].decode(errors="replace"))
        for rid, blocks in self.leases.expire():
            log.warning("request %s: lease on %d blocks expired: no decode read them", rid,
                        len(blocks))
            self.metrics.expired()
            out.free_blocks += blocks
        self.metrics.blocks_held.set(self.leases.num_blocks)

    def end_leases(self) -> None:
        """End every lease now (the next poll frees the blocks)."""
        for lease in self.leases.leases.values():
            lease.deadline = 0.0

    def busy(self) -> bool:
        return bool(self.leases.leases)
