"""Builds the connector a --kv-transfer-config names, over a rank's KV cache."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.connector import PDConnector
from pdserve.kv_transfer.interface import ConnectorContext, TPChannel
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.kv_transfer.nixl_transport import NixlTransport
from pdserve.kv_transfer.tp_transport import TPTransport
from pdserve.model.kv_cache import KVCache
from pdserve.platforms.base import Platform


def make_connector(config: KVTransferConfig, ctx: ConnectorContext, cache: KVCache,
                   platform: Platform, side_channel: tuple[str, int],
                   tp: TPChannel | None = None, registry: CollectorRegistry | None = None
                   ) -> PDConnector:
    transport = NixlTransport.for_cache(config, ctx.engine_id, cache, platform, side_channel,
                                        ctx.tp_size)
    if tp is not None:
        transport = TPTransport(transport, tp)
    metrics = TransferMetrics(registry or CollectorRegistry(), ctx.engine_id)
    metrics.reader_notifications.set_function(lambda: transport.readers.received)
    metrics.converted.set_function(lambda: transport.converted)
    return PDConnector(config, ctx, transport, metrics)
