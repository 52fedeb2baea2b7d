"""Which grammar library pdserve uses (docs/benchmarks.md, issue 29): xgrammar against
llguidance on this CPU, with the embedded SmolLM2 tokenizer and a realistic JSON schema.
Each of 32 sequences follows its own valid document token by token; a step fills all 32
rows of one bitmask (each library's batch call) and accepts each row's token. Needs both
libraries: pip install llguidance; pip install --no-deps xgrammar apache-tvm-ffi.

    python scripts/grammar_libs.py [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pdserve.model.loader import resolve
from pdserve.model.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40},
            "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9.]+$"},
            "tier": {"enum": ["free", "pro", "enterprise"]}},
            "required": ["name", "email", "tier"]},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string"}, "quantity": {"type": "integer"},
                "price": {"type": "number"}},
            "required": ["sku", "quantity", "price"]}},
        "paid": {"type": "boolean"},
        "note": {"type": ["string", "null"]}},
    "required": ["id", "customer", "items", "paid"],
}
VOCAB = 49152
BATCH = 32


def documents(n: int) -> list[str]:
    return [json.dumps({
        "id": 1000 + i, "customer": {"name": f"Customer number {i}",
                                     "email": f"user{i}@example.com",
                                     "tier": ["free", "pro", "enterprise"][i % 3]},
        "items": [{"sku": f"SKU-{i}-{j}", "quantity": j + 1, "price": 9.99 * (j + 1)}
                  for j in range(1 + i % 3)],
        "paid": i % 2 == 0, "note": None if i % 2 else "leave at the door"},
        separators=(",", ":")) for i in range(n)]


def run(fill, accept, steps: list[list[int]]) -> tuple[float, int]:
    """Seconds spent and steps taken, rows dropping out as their documents end."""
    start = time.perf_counter()
    for step in steps:
        fill(step)
        accept(step)
    return time.perf_counter() - start, len(steps)


def by_step(seqs: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Per step, the (row, token) pairs still running."""
    return [[(r, s[i]) for r, s in enumerate(seqs) if i < len(s)]
            for i in range(max(map(len, seqs)))]


def bench_llguidance(tok: Tokenizer, seqs: list[list[int]], threads: int) -> dict:
    import llguidance
    import llguidance.torch as llt

    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=VOCAB,
                                   eos_token=sorted(tok.eos_token_ids))
    setup = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in seqs]
    compile_s = time.perf_counter() - start
    executor = llguidance.LLExecutor(threads)
    mask = llt.allocate_token_bitmask(BATCH, VOCAB)

    def fill(step):
        llt.fill_next_token_bitmask_par(executor, [(matchers[r], r) for r, _ in step], mask)

    def accept(step):
        for r, t in step:
            assert matchers[r].consume_token(t), matchers[r].get_error()

    seconds, n = run(fill, accept, by_step(seqs))
    return {"tokenizer_s": setup, "compile_s": compile_s, "step_ms": 1e3 * seconds / n}


def bench_xgrammar(tok: Tokenizer, seqs: list[list[int]], threads: int) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo([tok.backend.id_to_token(i) for i in range(tok.vocab_size)],
                             xgr.VocabType.BYTE_LEVEL, vocab_size=VOCAB,
                             stop_token_ids=sorted(tok.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=threads)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                            separators=(",", ":"))
    compile_s = time.perf_counter() - start
    matchers = [xgr.GrammarMatcher(compiled) for _ in seqs]
    batch = xgr.BatchGrammarMatcher(threads)
    mask = xgr.allocate_token_bitmask(BATCH, VOCAB)

    def fill(step):
        batch.batch_fill_next_token_bitmask([matchers[r] for r, _ in step], mask,
                                            [r for r, _ in step])

    def accept(step):
        for r, t in step:
            assert matchers[r].accept_token(t)

    seconds, n = run(fill, accept, by_step(seqs))
    return {"tokenizer_s": setup, "compile_s": compile_s, "step_ms": 1e3 * seconds / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = Tokenizer.from_folder(resolve(None), [2])
    seqs = [tok.encode(d) for d in documents(BATCH)]
    print(f"{BATCH} sequences, {sum(map(len, seqs)) / BATCH:.0f} tokens each on average, "
          f"{args.threads} thread(s)")
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        r = bench(tok, seqs, args.threads)
        print(f"{name:>10}: tokenizer setup {r['tokenizer_s']:.2f} s, compile {r['compile_s']:.3f}"
              f" s, one step of {BATCH} rows (mask fill + accept) {r['step_ms']:.2f} ms")


if __name__ == "__main__":
    main()
