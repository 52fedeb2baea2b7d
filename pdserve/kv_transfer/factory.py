"""Builds the connector a --kv-transfer-config names."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from pdserve.config import ConfigError, KVTransferConfig
from pdserve.kv_transfer.connector import PDConnector
from pdserve.kv_transfer.host_buffer import HostBuffer
from pdserve.kv_transfer.metrics import TransferMetrics

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine


def make_connector(config: KVTransferConfig, engine: LLMEngine,
                   registry: CollectorRegistry | None, side_channel: tuple[str, int]
                   ) -> PDConnector:
    from pdserve.kv_transfer.nixl_connector import NixlTransport

    host, port = side_channel
    shape = engine.cache.shape
    layout = {"num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads,
              "head_dim": shape.head_dim, "block_size": shape.block_size,
              "layout": shape.layout, "dtype": str(engine.dtype).removeprefix("torch."),
              "block_bytes": engine.cache.block_bytes}
    x = config.kv_connector_extra_config
    platform = engine.platform
    buffer_device = config.kv_buffer_device or platform.name
    try:
        platform.check_buffer_device(buffer_device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    staging = None
    if x.use_host_buffer or buffer_device != platform.name:
        staging = HostBuffer.mirror(platform, engine.cache.tensor)
    buffer = staging.host if staging else engine.cache.tensor
    transport = NixlTransport(engine.engine_id, buffer, layout, host, port,
                              x.handshake_timeout, x.side_channel_secret,
                              serve=config.is_producer)
    metrics = TransferMetrics(registry or CollectorRegistry(), engine.engine_id)
    return PDConnector(config, engine, transport, metrics, host, staging)
