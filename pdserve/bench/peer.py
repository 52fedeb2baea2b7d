"""pdserve against vLLM-CPU on this host, in one run: each server started as a user would
(defaults, apart from vLLM's thread binding), alone on the machine, the same work sent to
each, the ratios printed.

    pdserve bench peer                          # vLLM from ../shared/peer (install there)
    pdserve bench peer --peer /path/to/peer     # the folder with serve.sh and its venv
    pdserve bench peer --only prefill,batch     # some of the work
    pdserve bench peer --layout 1p1d            # `pdserve up` against vLLM's tuned 1P1D
    pdserve bench peer --peer-kind llamacpp --model model.Q4_0.gguf --pdserve-args='-q gguf'

Layouts: `mono` runs `pdserve serve` against `vllm serve` on every core; `1p1d` runs `pdserve
up` (one prefill, one decode, its proxy) against a vLLM prefill on core 0 and a vLLM decode on
core 1 (NixlConnector, the peer folder's two tuning patches on), fronted by `pdserve proxy`,
which both P/D protocols share, so that the proxy costs each side the same.

`--peer-kind llamacpp` runs llama.cpp's `llama-server` instead (built by the peer folder's
llamacpp.sh, started by its `serve`: every core, 16 slots, one unified KV cache) on the GGUF
file --gguf (by default --model, where that is one); pdserve serves --model with
--pdserve-args (`-q gguf`: the same file computed as stored). Only the mono layout.

Work: lone prompts of 1,000-7,900 tokens (max_tokens 1: the prefill's wall time); 64
sequences at once (64-512 tokens in, 64-512 out, ignore_eos: output throughput); Poisson
arrivals at 1 and 2 req/s of 512-token prompts with 64 output tokens (median TTFT, median
TPOT, p99 ITL); 256-token prompts with 128 output tokens, at most 1, 16 and 64 requests in
flight (output tok/s and median TPOT: decode as concurrency grows). Prompts are random token
ids, fresh for every request, so no prefix cache serves them. vLLM-CPU is never a dependency
of pdserve: without its folder (serve.sh, and the venv and HF model that folder's README
makes) this runs pdserve alone and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.bench import serve
from pdserve.bench.launch import free_port, launched, running, up_layout

MAX_MODEL_LEN = 8192  # room for the longest prompt, on both servers
RATES = (1.0, 2.0)
CONCURRENCY = (1, 16, 64)
# The longest ITL too: with 32 prompts a monolith's stalls behind prefills are ~1 % of its
# gaps at 1 req/s, so its p99 lands on either side of them from run to run.
SERVING_METRICS = (("median_ttft_ms", "median TTFT (ms)"), ("median_tpot_ms", "median TPOT (ms)"),
                   ("p99_itl_ms", "p99 ITL (ms)"), ("p100_itl_ms", "longest ITL (ms)"))
CONCURRENCY_METRICS = (("output_throughput", "output tok/s"),
                       ("median_tpot_ms", "median TPOT (ms)"))
WORK = ("prefill", "batch", "serve", "concurrency")


@dataclass(slots=True)
class Results:
    prefill_ms: dict[int, float] = field(default_factory=dict)
    batch_tok_s: float | None = None
    serving: dict[float, dict] = field(default_factory=dict)
    concurrency: dict[int, dict] = field(default_factory=dict)  # max in flight: result
    peak_rss_mb: float | None = None  # summed over the server's processes, at the end


def peak_rss_mb(root: int) -> float:
    """The peak resident memory (VmHWM) of process `root` and all its descendants, summed:
    `pdserve up` starts its instances in process groups of their own."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    tree, grew = {root}, True
    while grew:
        new = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= new
        grew = bool(new)
    total = 0
    for pid in tree:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines()
                       if line.startswith("VmHWM:")), 0)
    return total / 1024


def prefill_ms(url: str, model: str, tokens: int, runs: int, rng: random.Random) -> float:
    """Median wall time of a lone prompt of `tokens` fresh token ids with max_tokens 1."""
    times = []
    with httpx.Client(timeout=600) as client:
        for _ in range(runs):
            prompt = [rng.randrange(*serve.TOKEN_IDS) for _ in range(tokens)]
            start = time.perf_counter()
            r = client.post(url + "/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
            r.raise_for_status()
            times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def load(url: str, model: str, out: Path, seed: int, *flags: str) -> dict | None:
    """One `bench serve` run (greedy, ignore_eos, streamed); its result, None if it failed."""
    code = serve.main(["--base-url", url, "--model", model, "--seed", str(seed),
                       "--ignore-eos", "--no-progress", "--save-result", "--result-file",
                       str(out), "--metric-percentiles", "90,99,100", *flags])
    return json.loads(out.read_text()) if code == 0 else None


def measure(url: str, model: str, args: argparse.Namespace, tag: str) -> Results:
    res, work = Results(), args.only
    out = Path(args.out)
    prefill_ms(url, model, 200, 2, random.Random(0))  # warm-up, untimed
    if "prefill" in work:
        rng = random.Random(1)
        for n in args.prefill_lens:
            prefill_ms(url, model, n, 1, rng)  # untimed: each length's paths run warm
            res.prefill_ms[n] = prefill_ms(url, model, n, args.runs, rng)
            print(f"{tag}: {n}-token prefill {res.prefill_ms[n]:.0f} ms", flush=True)
    if "batch" in work:
        r = load(url, model, out / f"{tag}-batch.json", 0, "--num-prompts", "64",
                 "--random-input-len", "288", "--random-output-len", "288",
                 "--random-range-ratio", "0.77", "--num-warmups", "2")
        res.batch_tok_s = r["output_throughput"] if r else None
        print(f"{tag}: 64 at once {res.batch_tok_s} output tok/s", flush=True)
    if "serve" in work:
        for i, rate in enumerate(RATES):
            r = load(url, model, out / f"{tag}-rate{rate:g}.json", 10 + i, "--num-prompts",
                     str(args.num_prompts), "--random-input-len", "512",
                     "--random-output-len", "64", "--request-rate", str(rate),
                     "--num-warmups", "4")
            if r:
                res.serving[rate] = r
                print(f"{tag}: {rate:g} req/s median TTFT {r['median_ttft_ms']:.0f} ms, "
                      f"TPOT {r['median_tpot_ms']:.1f} ms, p99 ITL {r['p99_itl_ms']:.0f} ms",
                      flush=True)
    if "concurrency" in work:
        for c in CONCURRENCY:
            r = load(url, model, out / f"{tag}-concurrency{c}.json", 20 + c, "--num-prompts",
                     str(max(16, 2 * c)), "--random-input-len", "256",
                     "--random-output-len", "128", "--max-concurrency", str(c),
                     "--num-warmups", "2")
            if r:
                res.concurrency[c] = r
                print(f"{tag}: at most {c} in flight {r['output_throughput']:.0f} output "
                      f"tok/s, median TPOT {r['median_tpot_ms']:.1f} ms", flush=True)
    return res


def measured(server, url: str, model: str, args: argparse.Namespace, tag: str) -> Results:
    """`measure` against the server that the context manager `server` runs, then the peak
    memory of its processes."""
    with server as proc:
        res = measure(url, model, args, tag)
        res.peak_rss_mb = peak_rss_mb(proc.pid)
        return res


def run_pdserve(args: argparse.Namespace, model: str) -> Results:
    engine = ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", model,
              *(["--model", args.model] if args.model else []), *shlex.split(args.pdserve_args)]
    if args.layout == "1p1d":
        argv, url, prefill, decode = up_layout(engine)
        health = [prefill, decode, url]
    else:
        url = f"http://127.0.0.1:{free_port()}"
        argv, health = ["serve", "--port", url.rsplit(":", 1)[1], *engine], [url]
    server = launched(argv, health, log=Path(args.out) / f"pdserve-{args.layout}.log")
    return measured(server, url, model, args, "pdserve")


def run_vllm(args: argparse.Namespace, peer: Path, model: str) -> Results:
    env = os.environ | {"VLLM_PEER_MAX_LEN": str(MAX_MODEL_LEN), "VLLM_PEER_MODEL": model}
    serve_sh = shlex.quote(str(peer / "serve.sh"))
    if args.layout == "1p1d":
        ports = free_port(count=3)
        side = free_port(count=2)
        urls = [f"http://127.0.0.1:{p}" for p in (ports, ports + 1, ports + 2)]
        # One process group: both vLLM instances and the proxy stop together.
        script = (f"VLLM_PEER_TUNED=1 {serve_sh} prefill {ports} {side} 0 & "
                  f"VLLM_PEER_TUNED=1 {serve_sh} decode {ports + 1} {side + 1} 1 & "
                  f"{shlex.quote(sys.executable)} -m pdserve.entrypoints.cli proxy --port "
                  f"{ports + 2} --prefill {urls[0]} --decode {urls[1]} --tokenizer "
                  f"{shlex.quote(model)} & wait")
        url, cmd = urls[2], ["bash", "-c", script]
    else:
        url = f"http://127.0.0.1:{free_port()}"
        cores = f"0-{len(os.sched_getaffinity(0)) - 1}"  # its thread binding: every core
        cmd, urls = ["bash", str(peer / "serve.sh"), "mono", url.rsplit(":", 1)[1], cores], [url]
    server = running(cmd, urls, timeout=600, env=env, name=f"vllm ({args.layout})",
                     log=Path(args.out) / f"vllm-{args.layout}.log")
    return measured(server, url, model, args, "vllm")


def run_llamacpp(args: argparse.Namespace, peer: Path, model: str) -> Results:
    url = f"http://127.0.0.1:{free_port()}"
    cmd = ["bash", str(peer / "llamacpp.sh"), "serve", args.gguf, url.rsplit(":", 1)[1]]
    server = running(cmd, [url], timeout=600, name="llama-server",
                     log=Path(args.out) / "llamacpp.log")
    return measured(server, url, model, args, "llama.cpp")


def _ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def _load_rows(work: str, ours: dict, theirs: dict, metrics: tuple[tuple[str, str], ...]
               ) -> list[str]:
    """A row per (result key, name) of one `bench serve` run against the peer's."""
    return [f"| {work}: {name} | {ours[key]:.1f} | {theirs.get(key, 0):.1f} | "
            f"{_ratio(ours[key], theirs.get(key))} |" for key, name in metrics]


def report(ours: Results, peer: Results | None, name: str = "vLLM-CPU") -> str:
    """A markdown table: pdserve's figure, the peer's, and pdserve / peer (lower is better
    for times, higher for throughput)."""
    p = peer or Results()
    rows = [f"| work | pdserve | {name} | pdserve / {name} |", "|---|---:|---:|---:|"]
    for n, ms in ours.prefill_ms.items():
        theirs = p.prefill_ms.get(n)
        rows.append(f"| prefill {n} tokens (ms) | {ms:.0f} | {theirs or 0:.0f} | "
                    f"{_ratio(ms, theirs)} |")
    if ours.batch_tok_s:
        rows.append(f"| 64 sequences at once (output tok/s) | {ours.batch_tok_s:.0f} | "
                    f"{p.batch_tok_s or 0:.0f} | {_ratio(ours.batch_tok_s, p.batch_tok_s)} |")
    for rate, r in ours.serving.items():
        rows += _load_rows(f"{rate:g} req/s, 512 in / 64 out", r, p.serving.get(rate, {}),
                           SERVING_METRICS)
    for c, r in ours.concurrency.items():
        rows += _load_rows(f"at most {c} in flight, 256 in / 128 out", r,
                           p.concurrency.get(c, {}), CONCURRENCY_METRICS)
    if ours.peak_rss_mb:
        rows.append(f"| peak RSS, all processes (MB) | {ours.peak_rss_mb:.0f} | "
                    f"{p.peak_rss_mb or 0:.0f} | {_ratio(ours.peak_rss_mb, p.peak_rss_mb)} |")
    note = "" if peer else f"\n\n{name} was not run (no peer folder): pdserve alone."
    return "\n".join(rows) + note


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench peer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", default="../shared/peer",
                   help="folder with vLLM-CPU's serve.sh (its README installs the venv)")
    p.add_argument("--hf-model", default=os.environ.get("VLLM_PEER_MODEL", "/tmp/smollm2-hf"),
                   help="the embedded model as an HF folder, for vLLM (and as the name both "
                   "serve)")
    p.add_argument("--peer-kind", choices=("vllm", "llamacpp"), default="vllm")
    p.add_argument("--model", default=None,
                   help="what pdserve serves (default: the embedded model)")
    p.add_argument("--gguf", default=None,
                   help="llamacpp: the GGUF file llama-server serves (default: --model)")
    p.add_argument("--pdserve-args", default="",
                   help="more flags for pdserve's servers, e.g. '--quantization gguf'")
    p.add_argument("--layout", choices=("mono", "1p1d"), default="mono",
                   help="mono: pdserve serve against vllm serve; 1p1d: pdserve up against "
                   "vLLM's prefill and decode behind a proxy")
    p.add_argument("--only", default=",".join(WORK),
                   help=f"comma-separated: {', '.join(WORK)}")
    p.add_argument("--prefill-lens", default="1000,2000,4000,7900",
                   help="prompt lengths of the lone prefills")
    p.add_argument("--runs", type=int, default=3, help="timed runs per prefill length")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts per serving rate")
    p.add_argument("--out", default="results/peer", help="folder for the runs' JSON")
    args = p.parse_args(argv)
    args.only = set(args.only.split(","))
    args.prefill_lens = [int(n) for n in args.prefill_lens.split(",")]
    if not all(0 < n < MAX_MODEL_LEN for n in args.prefill_lens):
        p.error(f"--prefill-lens: each between 1 and {MAX_MODEL_LEN - 1}")
    if bad := args.only - set(WORK):
        p.error(f"--only: unknown work {', '.join(sorted(bad))}")
    if args.peer_kind == "llamacpp":
        args.gguf = args.gguf or (args.model if str(args.model).endswith(".gguf") else None)
        if args.gguf is None or args.layout != "mono":
            p.error("--peer-kind llamacpp: a GGUF file (--gguf, or --model FILE.gguf) and "
                    "the mono layout")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    peer = Path(args.peer)
    if args.peer_kind == "llamacpp":
        name, model = "llama.cpp", Path(args.gguf).name
        has_peer = (peer / "llamacpp.sh").exists() and Path(args.gguf).exists()
        missing = f"{peer}/llamacpp.sh and {args.gguf}"
    else:
        name, model = "vLLM-CPU", args.hf_model
        has_peer = (peer / "serve.sh").exists() and Path(args.hf_model, "config.json").exists()
        missing = f"{peer}/serve.sh and {args.hf_model}"
    if not has_peer:
        print(f"no {name} peer ({missing}): pdserve alone", file=sys.stderr)
    ours = run_pdserve(args, model if has_peer else "pdserve")
    theirs = None if not has_peer else run_llamacpp(args, peer, model) \
        if args.peer_kind == "llamacpp" else run_vllm(args, peer, model)
    print(f"layout: {args.layout}")
    print(report(ours, theirs, name))
    print(f"server logs and each run's JSON: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
