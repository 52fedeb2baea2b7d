"""vLLM's NixlConnector protocol over any Transport: the prefill side (producer.py) holds
finished prompts' blocks for decodes, the decode side (consumer.py) pulls them. This facade
is what the engine sees (interface.py); it runs on the engine thread."""

from __future__ import annotations

import logging
import time
from typing import Any

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.consumer import Consumer
from pdserve.kv_transfer.interface import (
    ConnectorContext,
    KVConnector,
    KVConnectorOutput,
    Load,
    RemotePrefill,
)
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.kv_transfer.params import FirstToken, KVParams
from pdserve.kv_transfer.producer import Producer
from pdserve.kv_transfer.transport import Transport

log = logging.getLogger("pdserve.kv_transfer")
LOG_EVERY_S = 10


class PDConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, ctx: ConnectorContext, transport: Transport,
                 metrics: TransferMetrics) -> None:
        self.config, self.ctx, self.transport, self.metrics = config, ctx, transport, metrics
        self.producer = Producer(ctx, transport, metrics,
                                 config.kv_connector_extra_config.kv_lease_duration)
        self.consumer = Consumer(config, ctx, transport, metrics)
        self._last_log = 0.0
        self._last_pulls = 0

    def on_new_request(self, request_id: str, params: KVParams | None,
                       num_prompt_tokens: int) -> RemotePrefill | None:
        if params is None or not params.pulls or not self.config.is_consumer:
            return None
        return self.consumer.on_new_request(request_id, params, num_prompt_tokens)

    def start_loads(self, loads: list[Load]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        self.consumer.start_loads(loads, out)
        return out

    def request_finished(self, request_id: str, params: KVParams | None, block_ids: list[int],
                         first_token: FirstToken | None) -> tuple[bool, KVParams | None]:
        if self.consumer.finished(request_id, block_ids):
            return True, None
        if params is not None and params.do_remote_decode and self.config.is_producer and \
                first_token is not None:
            return True, self.producer.hold(request_id, block_ids, first_token)
        return False, None

    def poll(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        self.producer.poll(out)
        self.consumer.poll(out)
        self._log_stats()
        return out

    def busy(self) -> bool:
        return self.consumer.busy() or self.producer.busy()

    def poll_interval(self) -> float:
        return 0.001 if self.consumer.pulls else 0.01 if self.producer.busy() else 0.05

    def end_leases(self) -> None:
        self.producer.end_leases()

    def info(self) -> list[dict[str, Any]]:
        return [{"tp_rank": 0, **r, "dp_rank": self.ctx.dp_rank} for r in self.transport.ranks()]

    def close(self) -> None:
        self.consumer.close()
        self.transport.close()

    def _log_stats(self) -> None:
        now, m = time.monotonic(), self.metrics
        if now - self._last_log < LOG_EVERY_S:
            return
        self._last_log = now
        held = self.producer.leases.num_blocks
        if m.num_pulls != self._last_pulls or held:  # only while transfers happen
            self._last_pulls = m.num_pulls
            log.info("KV transfer: %d pulls, %.1f MB, %d failures, %d blocks held, "
                     "%d leases expired", m.num_pulls, m.num_bytes / 1e6, m.num_failures,
                     held, m.num_expired)
