"""Incremental detokenization with the model's real tokenizer: streamed text equals the full
decode (multi-byte characters never split), stop strings cut the text and end requests."""

from __future__ import annotations

import pytest

from pdserve.engine.detokenizer import Detokenizer
from pdserve.engine.request import Request
from tests.utils import PASSAGE, greedy, run_engine

TEXTS = {
    "english": "The capital of France is Paris, and  double  spaces stay.",
    "accents": "Ünïcödé — “quotes”, héllo wörld, €5 and ½ cup",
    "cjk": "日本語のテキストと中文字符",
    "emoji": "emoji 🙂👍🏽 done 🇫🇷!",
    "code": PASSAGE[:400],
}


def _stream(tokenizer, ids: list[int], stop: list[str]) -> tuple[list[str], Detokenizer, int]:
    """Feed ids one at a time; return the pieces handed out, the detokenizer, and how many
    tokens it took until a stop string matched (all of them if none did)."""
    detok, pieces = Detokenizer(tokenizer, stop), []
    for n, token in enumerate(ids, 1):
        if detok.add(token):
            pieces.append(detok.take(final=True))
            return pieces, detok, n
        pieces.append(detok.take(final=False))
    pieces.append(detok.take(final=True))
    return pieces, detok, len(ids)


@pytest.mark.parametrize("name", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, name):
    ids = tokenizer.encode(TEXTS[name])
    pieces, _, _ = _stream(tokenizer, ids, [])
    assert "".join(pieces) == tokenizer.decode(ids) == TEXTS[name]
    assert not any("\ufffd" in p for p in pieces), pieces  # no half characters streamed


@pytest.mark.parametrize(("name", "stop", "before"), [
    ("english", ["Paris"], "The capital of France is "),
    ("english", ["zzz", "of Fr", "is"], "The capital "),  # the earliest match wins
    ("cjk", ["テキスト"], "日本語の"),  # a multi-byte stop string spanning tokens
    ("emoji", ["👍"], "emoji 🙂"),  # a stop string inside a multi-token character
])
def test_stop_string_cuts_the_text(tokenizer, name, stop, before):
    ids = tokenizer.encode(TEXTS[name])
    pieces, detok, n = _stream(tokenizer, ids, stop)
    assert n < len(ids)
    assert detok.text == before
    # Held-back text: nothing past the cut was ever handed out.
    assert "".join(pieces) == before


def test_no_stop_string_matches_across_the_whole_text(tokenizer):
    ids = tokenizer.encode(TEXTS["code"])
    pieces, detok, n = _stream(tokenizer, ids, ["never appears"])
    assert n == len(ids) and "".join(pieces) == detok.text == TEXTS["code"]


def test_stop_string_ends_an_engine_request(engine_f32):
    ids = engine_f32.tokenizer.encode("The capital of France is")
    free = run_engine(engine_f32, [Request("free", ids, greedy(16, ignore_eos=True))])["free"]
    words = free.text.split()
    assert len(words) >= 3, free.text
    stop = words[2]  # a word well inside the greedy continuation
    got = run_engine(engine_f32, [Request("stop", ids, greedy(16, stop=[stop]))])["stop"]
    assert got.finish_reason == "stop"
    assert got.text == free.text[:free.text.index(stop)]
    assert got.token_ids == free.token_ids[:len(got.token_ids)]
    assert len(got.token_ids) < len(free.token_ids)


def test_stop_token_id_ends_an_engine_request(engine_f32):
    ids = engine_f32.tokenizer.encode("The capital of France is")
    free = run_engine(engine_f32, [Request("f", ids, greedy(8, ignore_eos=True))])["f"]
    params = greedy(8, stop_token_ids=[free.token_ids[3]])
    got = run_engine(engine_f32, [Request("t", ids, params)])["t"]
    first = free.token_ids.index(free.token_ids[3])
    assert got.finish_reason == "stop" and got.token_ids == free.token_ids[:first + 1]
