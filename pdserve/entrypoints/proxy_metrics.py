"""Prometheus metrics of the proxy (`pdserve_proxy_*`), served on its /metrics."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from pdserve.entrypoints.routing import Pool

_BACKEND = ["backend", "role"]
# From a short prefill (tens of ms) to a long streamed generation (minutes).
_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ProxyMetrics:
    def __init__(self, pools: list[Pool]) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pdserve_proxy_requests", "Client requests by endpoint and "
                                "outcome", ["endpoint", "outcome"], registry=r)
        self.backend_requests = Counter(
            "pdserve_proxy_backend_requests", "Requests sent to a backend, by HTTP status",
            [*_BACKEND, "code"], registry=r)
        self.backend_seconds = Histogram(
            "pdserve_proxy_backend_request_seconds", "Backend request latency (a streamed "
            "answer: until its last byte)", _BACKEND, buckets=_SECONDS, registry=r)
        self.retries = Counter(
            "pdserve_proxy_retries", "Attempts that found this backend unreachable and moved "
            "on to the next", _BACKEND, registry=r)
        self.routes = Counter(
            "pdserve_proxy_routes", "Routing decisions: remote (disaggregated) or local "
            "prefill on a decode, with the reason", ["route", "reason"], registry=r)
        self.prefix_fallbacks = Counter(
            "pdserve_proxy_prefix_fallbacks", "Prefix-policy picks that left the prompt's "
            "home instance because it was too busy", ["role"], registry=r)
        r.register(_BackendGauges(pools))


# Read at each scrape from the pools' backends as they are then: discovery adds and drops them.
_GAUGES = (
    ("pdserve_proxy_backend_outstanding", "Requests in flight at a backend (this proxy's)",
     "outstanding"),
    ("pdserve_proxy_backend_queue", "A backend's queue as routing sees it: in flight here, "
     "or its reported waiting requests if more", "queue"),
    ("pdserve_proxy_backend_local_prefills", "Plain requests at a decode that it is "
     "prefilling itself (first token not yet back)", "local_prefills"),
    ("pdserve_proxy_backend_up", "0 while a backend that was unreachable is tried last (for "
     "a few seconds after); one series per backend the proxy knows now", "up"),
)


@dataclass(slots=True, eq=False)  # registries keep collectors in a dict
class _BackendGauges:  # a prometheus_client Collector
    pools: list[Pool]

    def collect(self):
        for name, doc, attr in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=_BACKEND)
            for pool in self.pools:
                for b in pool.backends:
                    family.add_metric([b.url, pool.name], float(getattr(b, attr)))
            yield family


def outcome(status: int) -> str:
    """The `outcome` label of a client request answered with `status`."""
    if status < 400:
        return "ok"
    if status == 499:
        return "cancelled"
    if status == 503:
        return "unavailable"
    return "client_error" if status < 500 else "server_error"
