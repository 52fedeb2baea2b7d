"""What disaggregation adds to TTFT: streamed requests through `pdserve up`'s proxy, set
against the prefill's own TTFT for the same requests (its histogram), in one run.

    pdserve bench handover --prompt-tokens 1024 --num-prompts 10
    pdserve bench handover --prompt-tokens 512 --no-core-loan   # the prefill on its own core
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx

from pdserve.bench.launch import launched, up_layout

TTFT = "pdserve_time_to_first_token_seconds"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench handover", description=__doc__)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-core-loan", action="store_true",
                   help="start pdserve up with --no-core-loan (the prefill keeps its own cores)")
    args = p.parse_args(argv)
    up, proxy, prefill, decode = up_layout(["--dtype", args.dtype]
                                           + ["--no-core-loan"] * args.no_core_loan)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
               for _ in range(args.num_prompts + 1)]
    # One client throughout: a new one per request costs ~10 ms of set-up (its SSL context
    # among it), which the handover would be charged with.
    with launched(up, [prefill, decode, proxy]), httpx.Client(timeout=300) as client:
        _stream(client, proxy, prompts[0], args.max_tokens)  # warm-up: handshake, allocations
        before = _histogram(prefill)
        ttfts = [_stream(client, proxy, prompt, args.max_tokens) for prompt in prompts[1:]]
        after = _histogram(prefill)
    prefill_ttft = (after[0] - before[0]) / (after[1] - before[1])
    proxy_ttft = statistics.mean(ttfts)
    result = {"prompt_tokens": args.prompt_tokens, "num_prompts": args.num_prompts,
              "proxy_ttft_mean_s": proxy_ttft, "proxy_ttft_median_s": statistics.median(ttfts),
              "prefill_ttft_mean_s": prefill_ttft,
              "handover_ratio": (proxy_ttft - prefill_ttft) / prefill_ttft}
    print("| prompt tokens | TTFT through proxy (mean) | prefill's own TTFT (mean) | "
          "(proxy - prefill) / prefill |\n|---|---|---|---|")
    print(f"| {args.prompt_tokens} | {proxy_ttft * 1e3:.1f} ms | {prefill_ttft * 1e3:.1f} ms | "
          f"{result['handover_ratio']:.1%} |")
    print(json.dumps(result))
    return 0


def _stream(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> float:
    """Time from sending to the first streamed token: its chunk, even where its text is
    still empty (a token holding part of a character), as the prefill's histogram counts
    the token, not its text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    return first if first is not None else float("nan")


def _histogram(url: str) -> tuple[float, float]:
    """(sum, count) of the prefill's TTFT histogram."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for part in ("_sum", "_count"):
            if line.startswith(TTFT + part):
                values[part] = float(line.rsplit(" ", 1)[1])
    return values["_sum"], values["_count"]


if __name__ == "__main__":
    raise SystemExit(main())
