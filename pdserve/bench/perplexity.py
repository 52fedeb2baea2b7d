"""Perplexity of a model over a real English text, as llama.cpp's `llama-perplexity` measures
it: the text cut into windows of --ctx tokens, each scored on its second half (the first
half is context), perplexity = exp(mean negative log-likelihood). The engine scores a window
as one request's prompt logprobs, so any --dtype and --quantization is measured the way it
serves.

The default text is Newton's Opticks (Project Gutenberg), which the `apache-tvm-ffi` package
(installed with xgrammar) ships in its libbacktrace test data: a text nobody here wrote.

    pdserve bench perplexity --quantization int8
    pdserve bench perplexity --model model.gguf --text book.txt --tokens 20000
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

from pdserve.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from pdserve.engine import build
from pdserve.engine.request import Request, SamplingParams
from pdserve.model.loader import model_name


def default_text() -> Path | None:
    spec = importlib.util.find_spec("tvm_ffi")
    if spec is None or not spec.submodule_search_locations:
        return None
    text = Path(spec.submodule_search_locations[0]) / "3rdparty" / "libbacktrace" / \
        "Isaac.Newton-Opticks.txt"
    return text if text.exists() else None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench perplexity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--text", type=Path, default=None,
                   help="a UTF-8 text file (default: Newton's Opticks, see above)")
    p.add_argument("--tokens", type=int, default=24576,
                   help="tokens of the text to score (from its start; default %(default)s)")
    p.add_argument("--ctx", type=int, default=512, help="window length (llama.cpp's -c)")
    return p.parse_args(argv)


def windows(tokens: list[int], ctx: int) -> list[list[int]]:
    """Whole windows of ctx tokens, in order (a last partial one is left out, as llama.cpp
    does)."""
    return [tokens[i:i + ctx] for i in range(0, len(tokens) - ctx + 1, ctx)]


def nll(prompt_logprobs: list[float], ctx: int) -> list[float]:
    """The negative log-likelihoods a window counts: of tokens ctx/2 + 1 .. ctx - 1, each
    predicted from all the tokens before it (prompt_logprobs[i] is token i + 1's)."""
    return [-lp for lp in prompt_logprobs[ctx // 2:]]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    text = args.text or default_text()
    if text is None or not text.exists():
        print("pdserve bench perplexity: error: no text (pass --text FILE)", file=sys.stderr)
        return 2
    engine = build.build_engine(EngineConfig(
        model=args.model, dtype=args.dtype, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.ctx, max_num_seqs=1,
        enable_prefix_caching=False, num_kv_blocks=args.ctx // 16 + 2))
    tokens = engine.tokenizer.encode(text.read_text(encoding="utf-8"))[:args.tokens]
    losses: list[float] = []
    for i, window in enumerate(windows(tokens, args.ctx)):
        req = Request(f"ppl{i}", window, SamplingParams(max_tokens=1, prompt_logprobs=0))
        engine.add_request(req)
        while engine.has_work():
            engine.step()
        losses += nll([p.logprob for p in req.prompt_logprobs], args.ctx)
    if not losses:
        print(f"pdserve bench perplexity: error: fewer than --ctx {args.ctx} tokens",
              file=sys.stderr)
        return 2
    ppl = math.exp(sum(losses) / len(losses))
    print(f"{model_name(args.model)}, {args.dtype}"
          f"{', ' + args.quantization if args.quantization else ''}"
          f"{', KV ' + args.kv_cache_dtype if args.kv_cache_dtype != 'auto' else ''}: "
          f"perplexity {ppl:.4f} over {len(losses)} scored tokens ({len(tokens)} of "
          f"{text.name}, windows of {args.ctx}, each scored on its second half)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
