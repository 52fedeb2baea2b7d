"""bench compare's tp2 layout: refused up front for a model TP=2 cannot split."""

from __future__ import annotations

import pytest

from pdserve.bench import compare


def test_tp2_needs_a_model_with_even_heads(tiny_llama):
    why = compare.check_tp2(None)  # the embedded SmolLM2
    assert "9 attention heads and 3 KV heads" in why and "--model" in why
    assert compare.check_tp2(str(tiny_llama)) is None


def test_tp2_with_the_embedded_model_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        compare.main(["--layouts", "tp1,tp2", "--out", "/nonexistent/never-written"])
    assert e.value.code == 2 and "layout tp2" in capsys.readouterr().err
