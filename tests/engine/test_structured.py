"""Structured output in the engine: specs compile once, bad ones fail with the library's
message, the sampler's mask keeps a constrained row to its grammar (greedy and sampled)
and leaves the others alone, and the engine ends a request when its grammar is complete."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pdserve.engine import sampler as sampler_module
from pdserve.engine.request import Request, SamplingParams
from pdserve.engine.sampler import Sampler
from pdserve.engine.structured import GrammarError, Grammars, GrammarSpec
from tests.utils import greedy, run_engine

VOCAB = 49152  # SmolLM2's model vocabulary
DIGITS = GrammarSpec("regex", "[0-9]{1,6}")


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, VOCAB)


def test_a_spec_compiles_once(tokenizer):
    g = Grammars(tokenizer, VOCAB)
    first = g.compile(GrammarSpec("regex", "[ab]+"))
    assert g.compile(GrammarSpec("regex", "[ab]+")) is first  # an equal spec: a cache hit
    g.compile(GrammarSpec.choices(["x", "y"]))
    info = g.compile.cache_info()
    assert (info.hits, info.misses) == (1, 2)


@pytest.mark.parametrize(("spec", "words"), [
    (GrammarSpec("regex", "a(b"), "parenthesis"),
    (GrammarSpec("grammar", "root ::= undefined_rule"), "undefined_rule"),
    (GrammarSpec.json_schema({"type": "objekt"}), "objekt"),
])
def test_a_bad_spec_fails_with_the_library_message(grammars, spec, words):
    with pytest.raises(GrammarError, match=words) as e:
        grammars.compile(spec)
    assert "/project/" not in str(e.value)  # the C++ source location is cut off


def _digit_only(tokenizer, token: int) -> bool:
    return re.fullmatch(r"[0-9]+", tokenizer.decode([token])) is not None


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_masked_row_never_gets_a_masked_token(grammars, tokenizer, temperature):
    rows = 16
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    forbidden = tokenizer.encode(" hello")[0]
    logits[:, forbidden] = 50.0  # every row's likeliest token by far
    raw = torch.log_softmax(logits, -1)
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=temperature, top_k=50,
                                                 repetition_penalty=1.2))
            for i in range(rows)]
    for r in reqs[::2]:  # even rows constrained, odd rows free
        r.matcher = grammars.matcher(DIGITS)
    for step in range(3):
        tokens, logprobs, _ = Sampler(seed=step).sample(logits.clone(), reqs)
        assert all(_digit_only(tokenizer, t) for t in tokens[::2]), tokens[::2]
        assert tokens[1::2] == [forbidden] * (rows // 2)
        # Logprobs are the raw model's, masked row or not.
        assert logprobs == pytest.approx(raw[torch.arange(rows), tokens].tolist(), abs=1e-5)


def test_padded_vocabulary_ids_are_masked(tokenizer):
    # A model whose logits outnumber the tokenizer's ids: those past it are never allowed.
    g = Grammars(tokenizer, VOCAB + 64)
    logits = torch.zeros(1, VOCAB + 64)
    logits[0, VOCAB:] = 100.0
    req = Request("r", [1], greedy(4))
    req.matcher = g.matcher(DIGITS)
    token = Sampler().sample(logits, [req])[0][0]
    assert token < VOCAB and _digit_only(tokenizer, token)


def test_unconstrained_batches_do_no_mask_work(monkeypatch):
    def fail(*_):
        raise AssertionError("masked an unconstrained batch")

    monkeypatch.setattr(sampler_module, "fill_bitmask", fail)
    tokens, _, _ = Sampler().sample(torch.randn(4, 100), [Request("r", [1], greedy(1))] * 4)
    assert len(tokens) == 4


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "rank": {"type": "integer"}},
          "required": ["city", "rank"]}


@pytest.mark.parametrize(("spec", "check"), [
    (GrammarSpec.json_schema(SCHEMA), lambda t: set(json.loads(t)) == {"city", "rank"}),
    (GrammarSpec("regex", r"(yes|no), because [a-z ]{3,30}\."),
     lambda t: re.fullmatch(r"(yes|no), because [a-z ]{3,30}\.", t)),
    (GrammarSpec.choices(["red", "green", 'say "blue"']),
     lambda t: t in ("red", "green", 'say "blue"')),
])
def test_engine_output_follows_the_grammar_and_stops_with_it(engine_f32, tokenizer, spec,
                                                             check):
    prompt = tokenizer.encode("Name a big city and its rank:")
    reqs = [Request(f"g{i}", prompt, SamplingParams(max_tokens=60, temperature=t, seed=i,
                                                    grammar=spec))
            for i, t in enumerate((0.0, 1.0, 1.0))]
    for gen in run_engine(engine_f32, reqs).values():
        assert gen.finish_reason == "stop", gen.text
        assert check(gen.text), gen.text
