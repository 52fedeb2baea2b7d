"""Builds the connector a --kv-transfer-config names, over a rank's KV cache."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pdserve.config import ConfigError, KVTransferConfig
from pdserve.kv_transfer.connector import PDConnector
from pdserve.kv_transfer.host_buffer import HostBuffer
from pdserve.kv_transfer.interface import ConnectorContext, TPChannel
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.kv_transfer.nixl_transport import NixlTransport
from pdserve.kv_transfer.tp_transport import TPTransport
from pdserve.model.kv_cache import KVCache
from pdserve.platforms.base import Platform


def needs_staging(config: KVTransferConfig, platform: Platform, tp_size: int) -> bool:
    """Whether NIXL reads a host mirror of the cache rather than the cache itself; refuses
    configurations that cannot work (before any rank is started)."""
    buffer_device = config.kv_buffer_device or platform.name
    try:
        platform.check_buffer_device(buffer_device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    staging = config.kv_connector_extra_config.use_host_buffer or buffer_device != platform.name
    if staging and tp_size > 1:
        raise ConfigError("a host staging buffer (use_host_buffer, or kv_buffer_device cpu on "
                          "a GPU) is not supported with --tensor-parallel-size > 1")
    return staging


def make_connector(config: KVTransferConfig, ctx: ConnectorContext, cache: KVCache,
                   platform: Platform, side_channel: tuple[str, int],
                   tp: TPChannel | None = None, registry: CollectorRegistry | None = None
                   ) -> PDConnector:
    staging = HostBuffer.mirror(platform, cache.tensor) \
        if needs_staging(config, platform, ctx.tp_size) else None
    transport = NixlTransport.for_cache(config, ctx.engine_id, cache,
                                        staging.host if staging else cache.tensor, side_channel,
                                        ctx.tp_size)
    if tp is not None:
        transport = TPTransport(transport, tp)
    metrics = TransferMetrics(registry or CollectorRegistry(), ctx.engine_id)
    metrics.reader_notifications.set_function(lambda: transport.readers.received)
    return PDConnector(config, ctx, transport, metrics, staging)
