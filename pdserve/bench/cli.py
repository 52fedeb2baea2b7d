"""`pdserve bench NAME ...`: dispatch to a benchmark module's main()."""

from __future__ import annotations

import importlib

BENCHMARKS = {
    "compare": "1P1D vs TP=1 vs DP=2 on the same workload, with plots",
    "handover": "TTFT through pdserve up vs the prefill's own TTFT",
    "multiturn": "multi-turn chat: TTFT and prompt tokens computed per turn, three layouts",
    "offline": "engine throughput vs HF transformers (nano-vllm style)",
    "peer": "pdserve vs vLLM-CPU in one run: long prefills, 64 at once, serving",
    "perplexity": "perplexity over a real text, as llama-perplexity measures it",
    "serve": "online serving load (vllm bench serve style) against an OpenAI API",
    "structured": "the sampler's step with N grammar-constrained rows vs N free ones",
    "transfer": "KV pull rate over NIXL vs memcpy",
    "weights": "a shape's random weights written as an HF folder, for peers to load",
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS))
    p.add_argument("name", choices=sorted(BENCHMARKS))
    p.add_argument("args", nargs="...", help="the benchmark's own flags (--help for them)")
    p.set_defaults(run=lambda a: importlib.import_module(f"pdserve.bench.{a.name}").main(a.args))
