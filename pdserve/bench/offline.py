"""Offline throughput, nano-vllm style: N sequences of random token ids (seeded), random
input and output lengths, ignore_eos, all submitted to the engine at once; then the same
sequences through HF transformers `generate` in the same process, same dtype and threads,
so the ratio survives a noisy shared machine. Also the engine's pure decode step time at a
few batch sizes.

    pdserve bench offline                         # 64 seqs, in/out 64..512, float32
    python -m pdserve.bench.offline --num-seqs 32 --skip-hf
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from pdserve.config import KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS, EngineConfig
from pdserve.engine import build
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import Request, SamplingParams, Status
from pdserve.model.linear import Weight
from pdserve.model.loader import TORCH_DTYPES, model_name, resolve
from pdserve.model.quant import QuantWeight

MAX_TOKEN_ID = 10000  # nano-vllm draws prompt ids from [0, 10000]


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench offline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--min-input", type=int, default=64)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--min-output", type=int, default=64)
    p.add_argument("--max-output", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=sorted(TORCH_DTYPES))
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="dummy: random weights of --model's config (benchmarks/models); "
                        "implies --skip-hf")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true", help="engine only")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="engine batch limit (default: all sequences at once)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=EngineConfig().max_num_batched_tokens)
    p.add_argument("--decode-batches", default="1,16,64",
                   help="batch sizes for the decode step timing ('' to skip)")
    p.add_argument("--decode-context", type=int, default=128,
                   help="prompt tokens per sequence in the decode timing")
    p.add_argument("--decode-steps", type=int, default=10)
    p.add_argument("--prefill-lens", default="512",
                   help="prompt lengths for the lone-prefill timing ('' to skip)")
    p.add_argument("--prefill-runs", type=int, default=5)
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="the lone prefills also score their prompt (top K per position)")
    return p.parse_args(argv)


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    lens = [rng.randint(args.min_input, args.max_input) for _ in range(args.num_seqs)]
    prompts = [[rng.randint(0, MAX_TOKEN_ID) for _ in range(n)] for n in lens]
    outs = [rng.randint(args.min_output, args.max_output) for _ in range(args.num_seqs)]
    return Workload(prompts, outs)


def _blocks(num_tokens: int, block_size: int = 16) -> int:
    return -(-num_tokens // block_size)


def _decode_tokens(args: argparse.Namespace, batch: int) -> int:
    """Output tokens each sequence of the decode timing asks for: enough that the first
    ones prefilled still decode while the last prefill, and through every timed step."""
    prefill_steps = -(-batch * args.decode_context // args.max_num_batched_tokens) + 1
    return prefill_steps + args.decode_steps + 4


def engine_for(args: argparse.Namespace, w: Workload, batches: list[int],
                 prefills: list[int]) -> LLMEngine:
    # A pool for every sequence at once (as nano-vllm sizes it), so no run preempts.
    need = sum(_blocks(len(p) + o) for p, o in zip(w.prompts, w.output_lens, strict=True))
    decode_len = args.decode_context + _decode_tokens(args, max(batches, default=0))
    decode_need = max(max(batches, default=0) * _blocks(decode_len),
                      _blocks(max(prefills, default=0) + 1))
    max_len = max(len(p) + o for p, o in zip(w.prompts, w.output_lens, strict=True))
    seqs = args.max_num_seqs or max(args.num_seqs, *batches, 1)
    # No prefix cache: each attention path times the same prompts, and a cached prompt's
    # prefill would time nothing (random prompts share no prefixes, so the throughput run
    # loses nothing).
    return build.build_engine(EngineConfig(
        model=args.model, dtype=args.dtype, quantization=args.quantization,
        load_format=args.load_format, kv_cache_dtype=args.kv_cache_dtype,
        num_kv_blocks=max(need, decode_need) + 1,
        max_num_seqs=seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max(max_len, decode_len, *prefills, 2048), seed=args.seed,
        enable_prefix_caching=False))


def run_engine(engine: LLMEngine, w: Workload, tag: str = "seq") -> float:
    """Seconds to generate the whole workload, all requests added at once."""
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(w.prompts, w.output_lens, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        engine.add_request(Request(f"{tag}{i}", p, params))
    generated = 0
    while engine.has_work():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    assert generated == w.output_tokens, (generated, w.output_tokens)
    return elapsed


def decode_step_ms(engine: LLMEngine, args: argparse.Namespace, batch: int) -> float:
    """Median time of one step once `batch` sequences of `decode_context` tokens all decode."""
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=_decode_tokens(args, batch), temperature=0.0,
                            ignore_eos=True)
    reqs = [Request(f"decode{batch}-{i}",
                    [rng.randint(0, MAX_TOKEN_ID) for _ in range(args.decode_context)], params)
            for i in range(batch)]
    for r in reqs:
        engine.add_request(r)
    while any(r.num_output_tokens == 0 for r in reqs):  # prefills, not timed
        engine.step()
    times = []
    for _ in range(args.decode_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    assert all(r.status is Status.RUNNING for r in reqs), "a timed step ran a smaller batch"
    for r in reqs:
        engine.abort_request(r.request_id)
    return statistics.median(times) * 1000


def prefill_ms(engine: LLMEngine, args: argparse.Namespace, tokens: int) -> float:
    """Median time to prefill a lone prompt of `tokens` tokens (new ones each time: no
    prefix-cache hits) and sample its first token."""
    rng = random.Random(tokens)
    times = []
    for i in range(args.prefill_runs):
        req = Request(f"prefill{tokens}-{i}", [rng.randint(0, MAX_TOKEN_ID)
                                               for _ in range(tokens)],
                      SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                     prompt_logprobs=args.prompt_logprobs))
        engine.add_request(req)
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def attention_paths(engine: LLMEngine, measure, sizes: list[int]
                    ) -> dict[str, dict[int, float]]:
    """measure(size) for each size through the attention the engine uses and, where that
    is the paged kernels, through the gather + torch attention fallback too: the kernels'
    baseline, measured in the same run."""
    model = engine.runner.model
    kernel = model.paged
    paths = {"paged kernel": kernel, "torch": None} if kernel else {"torch": None}
    times = {}
    try:
        for name, path in paths.items():
            model.paged = path
            times[name] = {n: measure(n) for n in sizes}
    finally:
        model.paged = kernel
    return times


def run_hf(model, w: Workload, batch_size: int) -> tuple[float, int]:
    """Seconds for HF `generate` over the workload, and the tokens it generated.

    Its best fair shot: batches sorted by output length (decode steps dominate, so each
    batch runs about as many steps as its sequences asked for), then input length; left
    padding with an attention mask; a batch generates its longest requested output for
    every row (min_new_tokens = max_new_tokens: ignore_eos)."""
    order = sorted(range(len(w.prompts)), key=lambda i: (w.output_lens[i], len(w.prompts[i])))
    start, generated = time.perf_counter(), 0
    for b in range(0, len(order), batch_size):
        rows = order[b:b + batch_size]
        ids, mask = _left_pad([w.prompts[i] for i in rows])
        n = max(w.output_lens[i] for i in rows)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=0)
        generated += (out.shape[1] - ids.shape[1]) * len(rows)
    return time.perf_counter() - start, generated


def _left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def load_hf(args: argparse.Namespace):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve(args.model),
                                                dtype=TORCH_DTYPES[args.dtype]).eval()


def _warm_up(engine: LLMEngine, hf) -> None:
    """One short run each, untimed: first calls pay for allocator and kernel set-up."""
    w = Workload([list(range(100, 164))] * 2, [8, 8])
    run_engine(engine, w, tag="warmup")
    if hf is not None:
        run_hf(hf, w, 2)


def report(args: argparse.Namespace, w: Workload, engine_s: float, hf: tuple[float, int] | None,
           decode: dict[str, dict[int, float]], prefill: dict[str, dict[int, float]]) -> str:
    n = w.output_tokens
    lines = [
        f"{len(w.prompts)} sequences of random token ids (seed {args.seed}): input "
        f"{args.min_input}-{args.max_input} ({sum(map(len, w.prompts))} tokens), output "
        f"{args.min_output}-{args.max_output} ({n} tokens), ignore_eos, greedy; "
        f"{model_name(args.model)}, {args.dtype}"
        f"{', ' + args.quantization if args.quantization else ''}"
        f"{', KV ' + args.kv_cache_dtype if args.kv_cache_dtype != 'auto' else ''}"
        f"{', dummy weights' if args.load_format == 'dummy' else ''}, "
        f"{torch.get_num_threads()} torch threads",
        "",
        "| run | output tokens | time (s) | output tokens/s |",
        "|---|---:|---:|---:|",
        f"| pdserve LLMEngine | {n} | {engine_s:.1f} | {n / engine_s:.1f} |",
    ]
    if hf is not None:
        hf_s, hf_generated = hf
        lines += [f"| HF transformers generate (batch {args.hf_batch_size}) | {n} | {hf_s:.1f} "
                  f"| {n / hf_s:.1f} |",
                  f"| **pdserve / HF** | | | **{hf_s / engine_s:.2f}x** |", "",
                  f"HF generated {hf_generated} tokens to cover the {n} requested (a batch "
                  "runs to its longest output); only the requested ones are counted."]
    lines += _path_table(decode, f"Engine decode step, {args.decode_context}-token prompts, "
                         f"median of {args.decode_steps} steps, by attention:", "batch", "step")
    lines += _path_table(prefill, f"Engine prefill of a lone prompt (first token), median of "
                         f"{args.prefill_runs}, by attention:", "prompt tokens", "prefill")
    return "\n".join(lines)


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of weights a decode step reads: every layer's products and the lm_head, in the
    layout the decode products read (the pair-packed copy of a Weight)."""
    model = engine.runner.model
    linears = [w for x in model.layers for w in (x.qkv, x.o, x.gate_up, x.down)
               if w is not None] + [model.lm_head]
    return sum(w.nbytes if isinstance(w, QuantWeight) else
               w.pairs.nbytes if isinstance(w, Weight) else w.numel() * w.element_size()
               for w in linears)


def read_bandwidth(gib: int = 2, runs: int = 5) -> float:
    """GB/s this host reads at: torch summing a `gib` GiB float32 tensor, best of `runs`."""
    t = torch.ones(gib * 2**28)
    best = min(_timed(t.sum) for _ in range(runs))
    return t.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bandwidth_report(engine: LLMEngine, decode: dict[str, dict[int, float]], batch: int
                     ) -> str:
    """A decode step's weight reads per second against the host's read bandwidth."""
    nbytes, host = weight_bytes(engine), read_bandwidth()
    ms = next(iter(decode.values()))[batch]
    rate = nbytes / ms / 1e6
    return (f"\nWeights read per decode step: {nbytes / 1e9:.3f} GB; at batch {batch} "
            f"{rate:.1f} GB/s, {rate / host:.0%} of this host's read bandwidth ({host:.1f} "
            f"GB/s: {torch.get_num_threads()} threads summing 2 GiB of float32)")


def _path_table(times: dict[str, dict[int, float]], title: str, size: str, what: str
                ) -> list[str]:
    """Rows of times[path][size] ms (and tokens/s per decode step) with the torch / kernel
    ratio where both paths ran."""
    if not any(times.values()):
        return []
    names = list(times)
    rate = " | tokens/s" if what == "step" else ""
    lines = ["", title, "", f"| {size} | " + " | ".join(f"{n} {what} (ms){rate}" for n in names)
             + (" | torch / kernel |" if len(names) == 2 else " |"),
             "|---:|" + ("---:|" * (2 if rate else 1)) * len(names)
             + ("---:|" if len(names) == 2 else "")]
    for n in times[names[0]]:
        ms = [times[p][n] for p in names]
        cells = " | ".join(f"{m:.1f}" + (f" | {n * 1000 / m:.1f}" if rate else "") for m in ms)
        ratio = f" | **{ms[1] / ms[0]:.2f}x** |" if len(ms) == 2 else " |"
        lines.append(f"| {n} | {cells}{ratio}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not 1 <= args.min_input <= args.max_input or not 1 <= args.min_output <= args.max_output:
        print("pdserve bench offline: error: need 1 <= min <= max for input and output lengths",
              file=sys.stderr)
        return 2
    batches = [int(b) for b in args.decode_batches.split(",") if b.strip()]
    prefills = [int(n) for n in args.prefill_lens.split(",") if n.strip()]
    w = make_workload(args)
    engine = engine_for(args, w, batches, prefills)
    hf = None if args.skip_hf or args.load_format == "dummy" else load_hf(args)
    _warm_up(engine, hf)
    print(f"engine: {len(w.prompts)} sequences, {w.output_tokens} output tokens ...", flush=True)
    engine_s = run_engine(engine, w)
    hf_result = None
    if hf is not None:
        print(f"engine: {engine_s:.1f} s; HF transformers ...", flush=True)
        hf_result = run_hf(hf, w, args.hf_batch_size)
    decode = attention_paths(engine, lambda b: decode_step_ms(engine, args, b), batches)
    prefill = attention_paths(engine, lambda n: prefill_ms(engine, args, n), prefills)
    print(report(args, w, engine_s, hf_result, decode, prefill), flush=True)
    if batches:
        print(bandwidth_report(engine, decode, batches[0]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
