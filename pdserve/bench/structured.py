"""What structured output costs the sampler per step: N rows constrained by a JSON schema
(bitmask fill, apply, then each row's matcher accepting its token, as the engine does)
against the same N rows free. Logits are random, at the model's vocabulary size: the
model's forward is the same either way, so only the sampler's side is timed.

    pdserve bench structured                      # 32 rows, 200 steps, greedy and sampled
    pdserve bench structured --rows 64 --threads 1
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from pdserve.engine.request import Request, SamplingParams
from pdserve.engine.sampler import Sampler
from pdserve.engine.structured import Grammars, GrammarSpec
from pdserve.model.llama import ModelConfig
from pdserve.model.loader import resolve
from pdserve.model.tokenizer import Tokenizer

# An order record: nested object, enum, pattern, array of objects, numbers, nullable field.
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0},
    "customer": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9.]+$"},
        "tier": {"enum": ["free", "pro", "enterprise"]}}, "required": ["name", "email", "tier"]},
    "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "quantity": {"type": "integer"}, "price": {"type": "number"}},
        "required": ["sku", "quantity", "price"]}},
    "paid": {"type": "boolean"}, "note": {"type": ["string", "null"]}},
    "required": ["id", "customer", "items", "paid"]}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench structured", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a decode rank's)")
    return p.parse_args(argv)


def _step_ms(sampler: Sampler, reqs: list[Request], vocab: int, steps: int) -> float:
    """Median milliseconds of one step: sample, then advance the rows' matchers."""
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logits = torch.randn(len(reqs), vocab, generator=gen) * 4
        start = time.perf_counter()
        tokens, _, _ = sampler.sample(logits, reqs)
        for r, t in zip(reqs, tokens, strict=True):
            if r.matcher is not None:
                # A finished document starts over: every step is a mid-generation step.
                assert r.matcher.accept_token(t)
                if r.matcher.is_terminated():
                    r.matcher.reset()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    folder = resolve(args.model)
    config = ModelConfig.from_folder(folder)
    grammars = Grammars(Tokenizer.from_folder(folder, list(config.eos_token_ids)),
                        config.vocab_size)
    spec = GrammarSpec.json_schema(SCHEMA)
    start = time.perf_counter()
    grammars.compile(spec)
    print(f"{platform.processor() or platform.machine()}, {args.threads} thread(s), vocab "
          f"{config.vocab_size}; first compile (tokenizer info + schema) "
          f"{time.perf_counter() - start:.2f} s")
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=1 << 20, temperature=temperature)
        free = [Request(f"f{i}", [1], params) for i in range(args.rows)]
        constrained = [Request(f"c{i}", [1], params) for i in range(args.rows)]
        for r in constrained:
            r.matcher = grammars.matcher(spec)
        sampler = Sampler(seed=0)
        _step_ms(sampler, free + constrained, config.vocab_size, 5)  # warm up
        t_free = _step_ms(sampler, free, config.vocab_size, args.steps)
        t_con = _step_ms(sampler, constrained, config.vocab_size, args.steps)
        print(json.dumps({"sampling": "greedy" if temperature == 0 else "temperature 1",
                          "rows": args.rows, "free_ms": round(t_free, 3),
                          "constrained_ms": round(t_con, 3),
                          "overhead_ms": round(t_con - t_free, 3),
                          "overhead_us_per_token": round(1e3 * (t_con - t_free) / args.rows,
                                                         1)}))


if __name__ == "__main__":
    main()
