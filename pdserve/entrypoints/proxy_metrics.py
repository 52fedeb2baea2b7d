"""Prometheus metrics of the proxy (`pdserve_proxy_*`), served on its /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.entrypoints.routing import Backend, Pool

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
        outstanding = Gauge("pdserve_proxy_backend_outstanding", "Requests in flight at "
                            "a backend (this proxy's)", _BACKEND, registry=r)
        queue = Gauge("pdserve_proxy_backend_queue", "A backend's queue as routing sees it: "
                      "in flight here, or its reported waiting requests if more", _BACKEND,
                      registry=r)
        local = Gauge("pdserve_proxy_backend_local_prefills", "Plain requests at a decode "
                      "that it is prefilling itself (first token not yet back)", _BACKEND,
                      registry=r)
        up = Gauge("pdserve_proxy_backend_up", "0 while a backend that was unreachable is "
                   "tried last (for a few seconds after)", _BACKEND, registry=r)
        for pool in pools:
            for b in pool.backends:
                up.labels(b.url, pool.name).set_function(_getter(b, "up"))
                outstanding.labels(b.url, pool.name).set_function(_getter(b, "outstanding"))
                queue.labels(b.url, pool.name).set_function(_getter(b, "queue"))
                local.labels(b.url, pool.name).set_function(_getter(b, "local_prefills"))


def _getter(backend: Backend, attr: str):
    return lambda: float(getattr(backend, attr))


def outcome(status: int) -> str:
    """The `outcome` label of a client request answered with `status`."""
    if status < 400:
        return "ok"
    if status == 499:
        return "cancelled"
    if status == 503:
        return "unavailable"
    return "client_error" if status < 500 else "server_error"
