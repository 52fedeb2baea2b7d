"""`pdserve bench perplexity`: llama-perplexity's windows and counting, and the engine's
float32 figure equal to HF transformers' over the same windows."""

from __future__ import annotations

import math
import re

import torch

from pdserve.bench import perplexity


def test_windows_are_whole_and_each_scores_its_second_half():
    assert perplexity.windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # prompt logprobs of tokens 1..7 of an 8-token window: tokens 5, 6, 7 count (4 + 1 on)
    assert perplexity.nll([-1.0, -2, -3, -4, -5, -6, -7], 8) == [5, 6, 7]


def test_the_default_text_ships_in_an_installed_package():
    text = perplexity.default_text()
    assert text is not None and "OPTICKS" in text.read_text(encoding="utf-8")[:2000]


def test_float32_perplexity_is_hf_transformers(capsys, hf_model, tokenizer):
    assert perplexity.main(["--tokens", "1100", "--ctx", "512"]) == 0
    out = capsys.readouterr().out
    got = float(re.search(r"perplexity ([\d.]+) over 510 scored tokens", out).group(1))
    tokens = tokenizer.encode(perplexity.default_text().read_text(encoding="utf-8"))[:1100]
    losses = []
    with torch.inference_mode():
        for window in perplexity.windows(tokens, 512):
            logits = hf_model(torch.tensor([window])).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(window[1:])[:, None])
            losses += perplexity.nll(lp.squeeze(1).tolist(), 512)
    assert math.isclose(got, math.exp(sum(losses) / len(losses)), rel_tol=1e-4)
