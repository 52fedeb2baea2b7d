"""What every Prometheus metric of pdserve shares: one label, the engine id."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, disable_created_metrics

disable_created_metrics()  # the *_created series only add noise to every scrape


def labelled_factory(registry: CollectorRegistry, engine_id: str):
    """A maker of metrics in `registry` that are already labelled with `engine_id`."""
    def labelled(kind, name: str, doc: str, **kw):
        return kind(name, doc, ["engine_id"], registry=registry, **kw).labels(engine_id)
    return labelled
