"""Structured output: what a request's text must match (a JSON schema, a regex, a choice of
strings or an EBNF grammar), compiled by xgrammar once per distinct spec, a matcher per
request that follows its tokens, and the token bitmask of a batch's constrained rows (the
sampler applies it).

xgrammar is imported on first use, not with the engine: it imports transformers, which
costs a second or more that a server without constrained requests should not pay at start."""

from __future__ import annotations

import functools
import json
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

# request.py imports the spec, and the proxy request.py: no torch or tokenizer at import.
if TYPE_CHECKING:
    import torch
    import xgrammar

    from pdserve.model.tokenizer import Tokenizer

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar"]
CACHE_SIZE = 256  # distinct specs kept compiled (a JSON schema's grammar is ~100 KB-1 MB)
# xgrammar's errors start with "[time] /path/file.cc:line: "; a client needs the rest.
_ERROR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")


class GrammarError(ValueError):
    """The spec does not compile; the message is the library's."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A request's constraint: small, hashable (the compile cache's key) and picklable (it
    travels to data-parallel ranks inside SamplingParams). `value`: the schema as canonical
    JSON (key order kept: properties come out in the order given), the regex, the EBNF
    grammar, or the choices as a JSON list."""
    kind: GrammarKind
    value: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> GrammarSpec:
        return cls("json", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def choices(cls, options: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(options, ensure_ascii=False))


class Grammars:
    """Compiles specs for one tokenizer and model vocabulary, and makes matchers. Thread-safe:
    the HTTP handlers compile in worker threads, the engine thread then finds the result in
    the cache (the same object serves both where the engine runs in the server's process)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE
                 ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: its logits may outnumber the tokenizer's
        self._lock = threading.Lock()
        self._xgr_compiler: xgrammar.GrammarCompiler | None = None
        self.compile = functools.lru_cache(maxsize=cache_size)(self._compile)

    def matcher(self, spec: GrammarSpec) -> xgrammar.GrammarMatcher:
        return _xgr().GrammarMatcher(self.compile(spec))

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        c = self._compiler()
        # Compact JSON (no free whitespace): a small model let loose between tokens tends to
        # emit whitespace until max_tokens; with none allowed, every token moves it on.
        try:
            match spec.kind:
                case "json":
                    return c.compile_json_schema(spec.value, any_whitespace=False)
                case "json_object":  # any object: its properties are the model's to choose
                    return c.compile_json_schema('{"type":"object"}', any_whitespace=False,
                                                 strict_mode=False)
                case "regex":
                    return c.compile_regex(spec.value)
                case "choice":
                    return c.compile_grammar(_choice_ebnf(json.loads(spec.value)))
                case "grammar":
                    return c.compile_grammar(spec.value)
                case _:
                    raise GrammarError(f"unknown structured output kind {spec.kind!r}")
        except RuntimeError as e:
            raise GrammarError(_ERROR_PREFIX.sub("", str(e)).strip()) from None

    def _compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:  # built once, by whichever thread needs it first
            if self._xgr_compiler is None:
                self._xgr_compiler = _build_compiler(self.tokenizer, self.vocab_size)
            return self._xgr_compiler


def _build_compiler(tokenizer: Tokenizer, vocab_size: int) -> xgrammar.GrammarCompiler:
    from transformers import PreTrainedTokenizerFast  # imported by xgrammar anyway

    xgr = _xgr()
    # xgrammar reads the vocabulary's encoding (byte-level, byte-fallback) off a HF tokenizer.
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                              stop_token_ids=sorted(tokenizer.eos_token_ids))
    # Our LRU cache keys by spec; xgrammar's own would hold a second copy of each grammar.
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _choice_ebnf(options: list[str]) -> str:
    # A JSON string literal (quotes, backslashes, control characters escaped) is also an
    # EBNF string literal.
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


@functools.cache
def _batch() -> xgrammar.BatchGrammarMatcher:
    # One thread: on 2 cores, 32 rows filled in 0.08 ms with one, 0.23 ms with two
    # (scripts/grammar_libs.py); the rows' masks are mostly precomputed copies.
    return _xgr().BatchGrammarMatcher(max_threads=1)


def fill_bitmask(matchers: list[xgrammar.GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """One int32 bitmask [len(matchers), ceil(vocab/32)], filled in one call: bit j of row i
    says whether matchers[i] allows token j now. Ids the tokenizer lacks (a model's
    vocabulary may be padded past it) are never allowed: the grammar's vocabulary is the
    model's."""
    bitmask = _xgr().allocate_token_bitmask(len(matchers), vocab_size)
    _batch().batch_fill_next_token_bitmask(matchers, bitmask)
    return bitmask


def _xgr():
    import xgrammar

    return xgrammar
