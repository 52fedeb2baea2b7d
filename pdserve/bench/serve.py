"""Online serving benchmark against any OpenAI-compatible server (pdserve, its proxy, vLLM),
in the manner of `vllm bench serve`: random prompts, Poisson arrivals, streamed responses;
TTFT, TPOT, ITL, E2EL, throughputs and goodput with vLLM's definitions.

    pdserve bench serve --base-url http://127.0.0.1:8000 --endpoint /v1/completions \\
        --random-input-len 512 --random-output-len 64 --num-prompts 20 --request-rate 1 \\
        --ignore-eos --goodput ttft:500 tpot:50 --save-result
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

# Token ids sent as a /v1/completions prompt: clear of the low ids where tokenizers keep their
# special and control tokens, and below every common vocabulary size.
TOKEN_IDS = (1000, 40000)

# Short common English words, one BPE token each (with their leading space) in the usual
# tokenizers, so n random words make a chat prompt of about n tokens.
_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "number night point home water room mother area money story fact month lot right study "
    "book eye job word business issue side kind head house service friend father power hour "
    "game line end member law car city name team minute idea body back parent face level "
    "office door health person art war history party result change morning reason girl guy "
    "moment air teacher force education food tree river stone light sound music paper table"
)
WORDS = _WORDS.split()

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = {  # key -> (printed name, table header)
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass(slots=True)
class SampleRequest:
    prompt: list[int] | str
    prompt_len: int  # planned; the server's usage.prompt_tokens replaces it when it comes
    output_len: int


@dataclass(slots=True)
class RequestRecord:
    """One request's timeline, perf_counter seconds."""
    start: float
    prompt_len: int
    chunk_times: list[float] = field(default_factory=list)  # each chunk with choices
    end: float = 0.0
    output_tokens: int | None = None  # usage.completion_tokens
    success: bool = False
    error: str = ""
    text: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def num_output_tokens(self) -> int:
        # Without usage (a server ignoring include_usage), count chunks as vLLM's client would
        # count re-tokenized text: about one token each.
        return self.output_tokens or len(self.chunk_times)

    @property
    def tpot(self) -> float:
        """0 for a single-token answer: it has no decode phase (and passes any TPOT SLO)."""
        n = self.num_output_tokens
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else 0.0


# -- dataset ---------------------------------------------------------------------------------

def _lengths(rng: np.random.Generator, n: int, mean: int, ratio: float) -> list[int]:
    low, high = max(int(mean * (1 - ratio)), 1), max(int(mean * (1 + ratio)), 1)
    return rng.integers(low, high + 1, size=n).tolist()


def sample_random(n: int, input_len: int, output_len: int, ratio: float, chat: bool,
                  rng: np.random.Generator) -> list[SampleRequest]:
    """Token-id prompts for /v1/completions; random-word text for chat (no client tokenizer,
    so the server's usage tells the real prompt length)."""
    ins, outs = _lengths(rng, n, input_len, ratio), _lengths(rng, n, output_len, ratio)
    out = []
    for i, o in zip(ins, outs, strict=True):
        prompt: list[int] | str = (" ".join(rng.choice(WORDS, size=i).tolist()) if chat
                                   else rng.integers(*TOKEN_IDS, size=i).tolist())
        out.append(SampleRequest(prompt, i, o))
    return out


# -- metrics ---------------------------------------------------------------------------------

def _stats(key: str, seconds: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds or [0.0]) * 1000  # vLLM reports 0 for an empty set
    d = {f"mean_{key}_ms": float(ms.mean()), f"median_{key}_ms": float(np.median(ms)),
         f"std_{key}_ms": float(ms.std())}
    for p in percentiles:
        d[f"p{_pct_name(p)}_{key}_ms"] = float(np.percentile(ms, p))
    return d


def _pct_name(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _good(r: RequestRecord, slo_ms: dict[str, float]) -> bool:
    return all(getattr(r, k) * 1000 <= v for k, v in slo_ms.items())


def compute_metrics(records: list[RequestRecord], duration: float,
                    goodput: dict[str, float] | None = None,
                    percentiles: list[float] | None = None) -> dict[str, Any]:
    """vLLM bench serve's metrics from the recorded timelines. Failed requests count in
    `failed` only; `goodput` maps ttft/tpot/e2el to SLOs in ms (a request is good when it
    meets all of them)."""
    percentiles = [90.0, 99.0] if percentiles is None else percentiles
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.num_output_tokens for r in ok)
    m: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": (sum(_good(r, goodput) for r in ok) / duration
                            if goodput else None),
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    series = {"ttft": [r.ttft for r in ok],
              "tpot": [r.tpot for r in ok if r.num_output_tokens > 1],
              "itl": [g for r in ok for g in r.itls],
              "e2el": [r.e2el for r in ok]}
    for key, values in series.items():
        m.update(_stats(key, values, percentiles))
    return m


# -- client ----------------------------------------------------------------------------------

def _payload(model: str, req: SampleRequest, chat: bool, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if chat:
        body |= {"messages": [{"role": "user", "content": req.prompt}],
                 "max_completion_tokens": req.output_len}
    else:
        body |= {"prompt": req.prompt, "max_tokens": req.output_len}
    if ignore_eos:  # a vLLM extension: leave it out for servers that reject unknown fields
        body["ignore_eos"] = True
    return body


def _chunk_text(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any],
               prompt_len: int) -> RequestRecord:
    """Stream one request, timing every chunk that carries choices (vLLM's rule: the first is
    the first token)."""
    rec = RequestRecord(time.perf_counter(), prompt_len)
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:500]}"
                return rec
            async for line in resp.aiter_lines():
                _on_line(rec, line, time.perf_counter())
        rec.success = not rec.error and bool(rec.chunk_times)
        if not rec.error and not rec.chunk_times:
            rec.error = "the stream carried no choices (no first token)"
    except Exception as e:  # one bad response must not end the run: record it
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        rec.end = time.perf_counter()
    return rec


def _on_line(rec: RequestRecord, line: str, now: float) -> None:
    if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
        return
    chunk = json.loads(data)
    if err := chunk.get("error"):
        rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
    if choices := chunk.get("choices"):
        rec.chunk_times.append(now)
        rec.text += _chunk_text(choices[0])
    if usage := chunk.get("usage"):
        rec.output_tokens = usage.get("completion_tokens")
        rec.prompt_len = usage.get("prompt_tokens") or rec.prompt_len


def arrival_offsets(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process (the first
    at once), or all at once for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


async def run_load(client: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]],
                   prompt_lens: list[int], offsets: list[float], max_concurrency: int | None,
                   progress: bool) -> tuple[list[RequestRecord], float]:
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(bodies), disable=not progress, file=sys.stderr)

    async def one(body: dict[str, Any], prompt_len: int, at: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        # A request waiting for a concurrency slot is not timed yet (as in vLLM).
        if limit is None:
            rec = await send(client, url, body, prompt_len)
        else:
            async with limit:
                rec = await send(client, url, body, prompt_len)
        bar.update(1)
        return rec

    t0 = time.perf_counter()
    records = await asyncio.gather(*(one(b, p, a)
                                     for b, p, a in zip(bodies, prompt_lens, offsets,
                                                        strict=True)))
    duration = time.perf_counter() - t0
    bar.close()
    return list(records), duration


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    resp = await client.get(base_url + "/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


# -- report ----------------------------------------------------------------------------------

def format_table(m: dict[str, Any], percentiles: list[float]) -> str:
    rows = [f"{' Serving Benchmark Result ':=^50}"]

    def row(name: str, value: Any, fmt: str = ".2f") -> None:
        rows.append(f"{name:<40} {value:<10{fmt}}")

    if m.get("max_concurrency") is not None:
        row("Maximum request concurrency:", m["max_concurrency"], "")
    row("Request rate configured (RPS):", m["request_rate"])
    row("Successful requests:", m["completed"], "")
    row("Failed requests:", m["failed"], "")
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "")
    row("Total generated tokens:", m["total_output_tokens"], "")
    row("Request throughput (req/s):", m["request_throughput"])
    if m["request_goodput"] is not None:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    for key, (name, header) in LATENCY_METRICS.items():
        rows.append(f"{' ' + header + ' ':-^50}")
        row(f"Mean {name} (ms):", m[f"mean_{key}_ms"])
        row(f"Median {name} (ms):", m[f"median_{key}_ms"])
        row(f"Std {name} (ms):", m[f"std_{key}_ms"])
        for p in percentiles:
            row(f"P{_pct_name(p)} {name} (ms):", m[f"p{_pct_name(p)}_{key}_ms"])
    rows.append("=" * 50)
    return "\n".join(rows)


def per_request(records: list[RequestRecord]) -> dict[str, list]:
    """Per-request series for the result file (vLLM's names; 0 for failed requests)."""
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.num_output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft if r.success else 0.0 for r in records],
        "itls": [r.itls for r in records],
        "errors": [r.error for r in records],
        "generated_texts": [r.text for r in records],
    }


# -- CLI -------------------------------------------------------------------------------------

def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    slo = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_METRICS:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {SLO_METRICS}, "
                             f"got {item!r}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from None
        if slo[key] < 0:
            raise ValueError(f"--goodput {item!r}: an SLO must not be negative")
    return slo


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="default: the first id of /v1/models")
    p.add_argument("--dataset-name", default="random", choices=["random"])
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson arrivals; inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=0,
                   help="untimed requests sent together before the run, so it starts warm "
                   "(batch shapes seen, connections and KV handshakes made)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000")
    p.add_argument("--metric-percentiles", default="90,99")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-file", default=None, help="default: a dated name in the cwd")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for a connection or the next chunk")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        args.slo = parse_goodput(args.goodput)
    except ValueError as e:
        p.error(str(e))
    if not 0 <= args.random_range_ratio < 1:
        p.error("--random-range-ratio must be in [0, 1)")
    if args.num_prompts < 1 or args.request_rate <= 0:
        p.error("--num-prompts and --request-rate must be positive")
    if args.num_warmups < 0:
        p.error("--num-warmups must be >= 0")
    args.percentiles = [float(x) for x in args.metric_percentiles.split(",") if x]
    return args


async def _benchmark(args: argparse.Namespace) -> dict[str, Any] | None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits) as client:
        model = args.model or await first_model(client, base)
        chat = args.endpoint.endswith("chat/completions")
        rng = np.random.default_rng(args.seed)
        samples = sample_random(args.num_prompts, args.random_input_len,
                                args.random_output_len, args.random_range_ratio, chat, rng)
        bodies = [_payload(model, s, chat, args.ignore_eos) for s in samples]
        # The test prompt and warm-ups are prompts of their own: were they the run's, the
        # server's prefix cache would serve those prompts and flatter the figures.
        warm = [_payload(model, s, chat, args.ignore_eos) for s in sample_random(
            1 + args.num_warmups, args.random_input_len, args.random_output_len,
            args.random_range_ratio, chat, np.random.default_rng([args.seed, 1]))]
        url = base + args.endpoint
        # One request first, untimed: a misconfigured run fails at once and the server warms.
        print("Starting initial single prompt test run...", file=sys.stderr)
        test = await send(client, url, warm[0], 0)
        if not test.success:
            print(f"Initial test run failed: {test.error}", file=sys.stderr)
            return None
        if args.num_warmups:
            print(f"Warming up with {args.num_warmups} requests...", file=sys.stderr)
            await run_load(client, url, warm[1:], [0] * args.num_warmups,
                           [0.0] * args.num_warmups, args.max_concurrency, False)
        offsets = arrival_offsets(len(bodies), args.request_rate, rng)
        records, duration = await run_load(client, url, bodies,
                                           [s.prompt_len for s in samples], offsets,
                                           args.max_concurrency, not args.no_progress)
    m = compute_metrics(records, duration, args.slo, args.percentiles)
    config = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "base_url": base,
              "endpoint": args.endpoint, "model_id": model, "dataset_name": args.dataset_name,
              "random_input_len": args.random_input_len,
              "random_output_len": args.random_output_len,
              "random_range_ratio": args.random_range_ratio, "num_prompts": args.num_prompts,
              "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
              "ignore_eos": args.ignore_eos, "seed": args.seed, "goodput": args.slo,
              "percentiles": args.percentiles}
    return config | m | per_request(records)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    result = asyncio.run(_benchmark(args))
    if result is None:
        return 1
    print(format_table(result, args.percentiles))
    for err in sorted({e for e in result["errors"] if e})[:5]:
        print(f"error: {err}", file=sys.stderr)
    if args.save_result:
        path = args.result_file or (f"pdserve-bench-{args.request_rate}qps-"
                                    f"{os.path.basename(result['model_id'])}-"
                                    f"{result['date']}.json")
        with open(path, "w") as f:
            # inf is not JSON: write it as vLLM does, the string "inf"
            json.dump({k: "inf" if isinstance(v, float) and math.isinf(v) else v
                       for k, v in result.items()}, f, indent=2)
        print(f"result saved to {path}", file=sys.stderr)
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
