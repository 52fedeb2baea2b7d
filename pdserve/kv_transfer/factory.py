"""Builds the connector a --kv-transfer-config names."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from prometheus_client import CollectorRegistry

from pdserve.config import ConfigError, KVTransferConfig
from pdserve.kv_transfer.connector import PDConnector
from pdserve.kv_transfer.host_buffer import HostBuffer
from pdserve.kv_transfer.metrics import TransferMetrics

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine
    from pdserve.kv_transfer.nixl_connector import NixlTransport
    from pdserve.model.kv_cache import KVCache


def make_connector(config: KVTransferConfig, engine: LLMEngine,
                   registry: CollectorRegistry | None, side_channel: tuple[str, int]
                   ) -> PDConnector:
    x = config.kv_connector_extra_config
    platform = engine.platform
    buffer_device = config.kv_buffer_device or platform.name
    try:
        platform.check_buffer_device(buffer_device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    staging = None
    if x.use_host_buffer or buffer_device != platform.name:
        if engine.tp_group is not None:
            raise ConfigError("a host staging buffer (use_host_buffer, or kv_buffer_device "
                              "cpu on a GPU) is not supported with --tensor-parallel-size > 1")
        staging = HostBuffer.mirror(platform, engine.cache.tensor)
    transport = make_transport(config, engine.engine_id, engine.cache,
                               staging.host if staging else engine.cache.tensor, side_channel,
                               engine.config.tensor_parallel_size)
    if engine.tp_group is not None:
        from pdserve.kv_transfer.tp_transport import TPTransport
        transport = TPTransport(transport, engine.tp_group)
    metrics = TransferMetrics(registry or CollectorRegistry(), engine.engine_id)
    metrics.reader_notifications.set_function(lambda: transport.readers.received)
    return PDConnector(config, engine, transport, metrics, side_channel[0], staging)


def make_transport(config: KVTransferConfig, engine_id: str, cache: KVCache,
                   buffer: torch.Tensor, side_channel: tuple[str, int], tp_size: int = 1,
                   tp_rank: int = 0) -> NixlTransport:
    """One rank's NIXL transport over `buffer` (its KV shard, or a host mirror of it)."""
    from pdserve.kv_transfer.nixl_connector import NixlTransport

    s = cache.shape
    layout = {"num_layers": s.num_layers, "num_kv_heads": s.num_kv_heads,
              "head_dim": s.head_dim, "block_size": s.block_size, "layout": s.layout,
              "dtype": str(cache.tensor.dtype).removeprefix("torch."),
              "block_bytes": cache.block_bytes, "tp_size": tp_size, "tp_rank": tp_rank}
    x = config.kv_connector_extra_config
    return NixlTransport(engine_id, buffer, layout, *side_channel, x.handshake_timeout,
                         x.side_channel_secret, serve=config.is_producer)
