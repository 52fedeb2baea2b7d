"""Prometheus metrics of one engine, labelled by engine id (their names are an interface:
dashboards and the tests scrape them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.metrics import labelled_factory

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
            5.0, 10.0, 30.0)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry, engine_id: str) -> None:
        labelled = labelled_factory(registry, engine_id)

        self.running = labelled(Gauge, "pdserve_num_requests_running", "Requests running")
        self.waiting = labelled(Gauge, "pdserve_num_requests_waiting",
                                "Requests waiting (queued or pulling KV)")
        self.blocks_total = labelled(Gauge, "pdserve_kv_blocks_total", "KV blocks in the pool")
        self.blocks_free = labelled(Gauge, "pdserve_kv_blocks_free", "KV blocks free")
        self.prompt_tokens = labelled(Counter, "pdserve_prompt_tokens",
                                      "Prompt tokens of finished requests")
        self.prompt_computed = labelled(Counter, "pdserve_prompt_tokens_computed",
                                        "Prompt tokens run through the model")
        self.generation_tokens = labelled(Counter, "pdserve_generation_tokens",
                                          "Generated tokens")
        self.prefix_queries = labelled(Counter, "pdserve_prefix_cache_queries",
                                       "Tokens looked up in the prefix cache")
        self.prefix_hits = labelled(Counter, "pdserve_prefix_cache_hits",
                                    "Tokens found in the prefix cache (not recomputed)")
        self.preemptions = labelled(Counter, "pdserve_num_preemptions", "Preempted requests")
        self.loan_steps = labelled(Counter, "pdserve_core_loan_steps",
                                   "Steps run on cores lent by other engines: a "
                                   "prefill's by decodes, a decode's by an idle "
                                   "prefill (pdserve up's core loan)")
        self.loan_lent = labelled(Counter, "pdserve_core_loan_lent_seconds",
                                  "Seconds a busy decode engine lent its core to a prefill "
                                  "that fell behind (pdserve up's core loan)")
        self.ttft = labelled(Histogram, "pdserve_time_to_first_token_seconds",
                             "Time to first token", buckets=_LATENCY)
        self.itl = labelled(Histogram, "pdserve_inter_token_latency_seconds",
                            "Time between tokens", buckets=_LATENCY)
