"""KV transfer metrics, labelled by engine id (their names are an interface: dashboards and
the tests scrape them), plus plain totals for the periodic log line."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.metrics import labelled_factory

_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 30.0)
_DESCS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry, engine_id: str) -> None:
        labelled = labelled_factory(registry, engine_id)
        # Totals for the log line (Prometheus keeps its own values private).
        self.num_pulls = self.num_bytes = self.num_failures = self.num_expired = 0

        self.transfers = labelled(Counter, "pdserve_kv_transfers", "KV pulls completed")
        self.bytes = labelled(Counter, "pdserve_kv_transfer_bytes", "KV bytes pulled")
        self.bytes_saved = labelled(Counter, "pdserve_kv_transfer_bytes_saved",
                                    "KV bytes not pulled: the decode's prefix cache held them, "
                                    "or they lie before sliding-window layers' windows")
        self.seconds = labelled(Histogram, "pdserve_kv_transfer_seconds",
                                "Time of one KV pull, from posting the READ to completion",
                                buckets=_SECONDS)
        self.descriptors = labelled(Histogram, "pdserve_kv_transfer_descriptors",
                                    "NIXL descriptors per pull", buckets=_DESCS)
        self.failures = labelled(Counter, "pdserve_kv_transfer_failures",
                                 "KV pulls or handshakes that failed")
        self.lease_expired = labelled(Counter, "pdserve_kv_lease_expired",
                                      "Held prefill blocks freed because no decode came")
        self.blocks_held = labelled(Gauge, "pdserve_kv_blocks_held_for_remote",
                                    "Blocks a prefill holds for decodes to read")
        self.reader_notifications = labelled(
            Gauge, "pdserve_kv_reader_notifications",
            "Read-done notifications received from decode ranks (one per reader per request)")
        self.converted = labelled(
            Gauge, "pdserve_kv_converted_pulls",
            "KV pulls from a prefill of another KV layout or block size, converted here")
        self.recomputed = labelled(Counter, "pdserve_kv_transfer_recomputed",
                                   "Requests whose prompt was recomputed instead of pulled")

    def pulled(self, nbytes: int, descs: int, seconds: float) -> None:
        self.transfers.inc()
        self.bytes.inc(nbytes)
        self.descriptors.observe(descs)
        self.seconds.observe(seconds)
        self.num_pulls += 1
        self.num_bytes += nbytes

    def failed(self) -> None:
        self.failures.inc()
        self.num_failures += 1

    def expired(self) -> None:
        self.lease_expired.inc()
        self.num_expired += 1
