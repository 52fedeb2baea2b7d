"""Seed 000's comparison, on this host: start each layout the way a user would (no
per-layout tuning), run the same `bench serve` workload against each, and write a
markdown table and PNG plots (TTFT and ITL CDFs, latency vs request rate).

    pdserve bench compare --scenario benchmarks/seed000-2core.json --out results/compare

The tp2 layout (`serve --tensor-parallel-size 2`) needs a model whose attention and KV heads
divide by 2; the embedded SmolLM2 (9 heads, 3 KV heads) does not, so with tp2 pass
--model (or "model" in the scenario): an HF folder or GGUF of, e.g., a Llama/Qwen2 with
even head counts. Every layout then serves that model.
"""

from __future__ import annotations

import argparse
import json
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench import serve
from pdserve.bench.launch import free_port, launched, up_layout

LAYOUTS = ("tp1", "tp2", "dp2", "1p1d", "1p1d-strict", "1p1d-cond")
# `pdserve up` layouts and their flags: 1p1d-strict never prefills on the decode (up's
# default overflows a saturated prefill tier there); 1p1d-cond prefills short prompts,
# and every prompt while the prefill already queues one, on the decode.
UP_LAYOUTS = {"1p1d": [], "1p1d-strict": ["--max-prefill-queue", "off"],
              "1p1d-cond": ["--local-prefill-below", "128", "--max-prefill-queue", "1"]}


@dataclass(slots=True)
class Scenario:
    input_len: int = 512
    output_len: int = 64
    num_prompts: int = 40
    rates: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0])
    primary_rate: float = 1.0  # the rate the table and CDFs are drawn at
    layouts: list[str] = field(default_factory=lambda: ["tp1", "dp2", "1p1d"])  # tp2: opt in
    dtype: str = "auto"
    num_warmups: int = 4  # untimed requests, sent together, before each rate's run
    model: str | None = None  # None: the embedded SmolLM2 (which tp2 cannot split)

    @classmethod
    def load(cls, path: str | None) -> Scenario:
        return cls(**json.loads(Path(path).read_text())) if path else cls()


def start(layout: str, sc: Scenario) -> tuple[AbstractContextManager, str]:
    """The layout as `pdserve serve` / `pdserve up` start it by default; its URL."""
    common = ["--dtype", sc.dtype, *(["--model", sc.model] if sc.model else [])]
    if layout in UP_LAYOUTS:
        argv, proxy, prefill, decode = up_layout([*common, *UP_LAYOUTS[layout]])
        return launched(argv, [prefill, decode, proxy]), proxy
    port = free_port()
    dp, tp = {"tp1": ("1", "1"), "tp2": ("1", "2"), "dp2": ("2", "1")}[layout]
    url = f"http://127.0.0.1:{port}"
    return launched(["serve", "--port", str(port), *common, "--data-parallel-size", dp,
                     "--tensor-parallel-size", tp], [url]), url


def check_tp2(model: str | None) -> str | None:
    """Why tp2 cannot serve `model`, or None."""
    from pdserve.model import loader
    from pdserve.model.llama import ModelConfig

    try:
        ModelConfig.from_hf(loader.load_config(loader.resolve(model))).shard(2)
    except (ValueError, KeyError, loader.ModelLoadError) as e:
        return (f"layout tp2: {e}. Pass --model with a model whose heads and KV heads "
                "divide by 2, or leave tp2 out of --layouts")
    return None


def run_layout(layout: str, sc: Scenario, out: Path) -> dict[float, dict]:
    ctx, url = start(layout, sc)
    results = {}
    with ctx:
        for i, rate in enumerate(sc.rates):
            path = out / f"{layout}-rate{rate:g}.json"
            # Each rate its own prompts (the same for every layout): repeated ones would be
            # served from the prefix cache the previous rate filled.
            code = serve.main(["--base-url", url, "--seed", str(i),
                               "--random-input-len", str(sc.input_len),
                               "--random-output-len", str(sc.output_len), "--num-prompts",
                               str(sc.num_prompts), "--request-rate", str(rate),
                               "--ignore-eos", "--num-warmups", str(sc.num_warmups),
                               "--no-progress", "--save-result",
                               "--result-file", str(path)])
            if code == 0:
                results[rate] = json.loads(path.read_text())
    return results


def table(all_results: dict[str, dict[float, dict]], sc: Scenario) -> str:
    rows = ["| layout | rate (req/s) | median TTFT (ms) | p99 TTFT (ms) | median TPOT (ms) | "
            "p99 ITL (ms) | output tok/s | failed |", "|---|---|---|---|---|---|---|---|"]
    for layout, by_rate in all_results.items():
        for rate, r in sorted(by_rate.items()):
            rows.append(f"| {layout} | {rate:g} | {r['median_ttft_ms']:.0f} | "
                        f"{r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} | "
                        f"{r['p99_itl_ms']:.0f} | {r['output_throughput']:.1f} | "
                        f"{r['failed']} |")
    return "\n".join(rows) + "\n\n" + ratios(all_results, sc)


def ratios(all_results: dict[str, dict[float, dict]], sc: Scenario) -> str:
    """The seed's questions, as ratios of 1P1D to monolithic TP=1 in the same run."""
    mono, pd = all_results.get("tp1", {}), all_results.get("1p1d", {})
    rate = sc.primary_rate
    if rate not in mono or rate not in pd:
        return ""
    m, p = mono[rate], pd[rate]
    top = max(sc.rates)
    lines = [f"At {rate:g} req/s: 1P1D p99 ITL is {m['p99_itl_ms'] / p['p99_itl_ms']:.1f}x "
             f"lower than TP=1's (goal >= 5x); 1P1D median TTFT is "
             f"{p['median_ttft_ms'] / m['median_ttft_ms']:.2f}x TP=1's (goal <= 1.2x)."]
    if top in mono and top in pd:
        lines.append(f"At {top:g} req/s (the sweep's top): output throughput 1P1D / TP=1 = "
                     f"{pd[top]['output_throughput'] / mono[top]['output_throughput']:.2f} "
                     "(goal >= 1).")
    if (t := all_results.get("tp2", {}).get(rate)) is not None:
        lines.append(f"At {rate:g} req/s: TP=2 median TPOT is "
                     f"{t['median_tpot_ms'] / m['median_tpot_ms']:.2f}x TP=1's; 1P1D p99 ITL "
                     f"is {t['p99_itl_ms'] / p['p99_itl_ms']:.1f}x lower than TP=2's.")
    return "\n".join(lines) + "\n"


def plots(all_results: dict[str, dict[float, dict]], sc: Scenario, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for key, label in (("ttfts", "TTFT (s)"), ("itls", "ITL (s)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for layout, by_rate in all_results.items():
            if (r := by_rate.get(sc.primary_rate)) is None:
                continue
            values = sorted(_flat(r[key]))
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=layout)
        ax.set(xlabel=label, ylabel="fraction of " + ("requests" if key == "ttfts" else
                                                      "tokens"),
               title=f"{label.split()[0]} CDF at {sc.primary_rate:g} req/s", xscale="log")
        ax.legend()
        files.append(_save(fig, out / f"{key[:-1]}_cdf.png"))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for layout, by_rate in all_results.items():
        rates = sorted(by_rate)
        axes[0].plot(rates, [by_rate[x]["median_ttft_ms"] for x in rates], "o-", label=layout)
        axes[1].plot(rates, [by_rate[x]["p99_itl_ms"] for x in rates], "o-", label=layout)
    axes[0].set(xlabel="request rate (req/s)", ylabel="median TTFT (ms)", yscale="log")
    axes[1].set(xlabel="request rate (req/s)", ylabel="p99 ITL (ms)", yscale="log")
    axes[0].legend()
    files.append(_save(fig, out / "latency_vs_rate.png"))
    return files


def _flat(values: list) -> list[float]:
    flat = [v for x in values for v in (x if isinstance(x, list) else [x])]
    return [v for v in flat if isinstance(v, float | int) and v > 0 and math.isfinite(v)]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default=None, help="JSON file (see benchmarks/)")
    p.add_argument("--out", default="results/compare")
    p.add_argument("--layouts", default=None, help=f"comma list of {', '.join(LAYOUTS)}")
    p.add_argument("--model", default=None, help="served by every layout (tp2 needs heads "
                   "and KV heads that divide by 2; the embedded SmolLM2's do not)")
    args = p.parse_args(argv)
    sc = Scenario.load(args.scenario)
    if args.layouts:
        sc.layouts = args.layouts.split(",")
    sc.model = args.model or sc.model
    if unknown := set(sc.layouts) - set(LAYOUTS):
        p.error(f"unknown layouts {sorted(unknown)}; choose from {', '.join(LAYOUTS)}")
    if "tp2" in sc.layouts and (why := check_tp2(sc.model)):
        p.error(why)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {layout: run_layout(layout, sc, out) for layout in sc.layouts}
    report = table(results, sc)
    (out / "compare.md").write_text(report)
    print(report)
    for f in plots(results, sc, out):
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
