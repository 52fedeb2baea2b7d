"""Prompt logprobs through the engine, float32: within 1e-4 of HF transformers' log_softmax
over the prompt (ranks and top-k too), the same whether the prompt runs in one chunk or
several, computed in full where the prefix cache holds the prompt, and no extra logits rows
for requests that do not ask."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.build import build_engine
from pdserve.engine.prompt_logprobs import span
from pdserve.engine.request import PromptLogprob, Request
from tests.utils import PASSAGE, greedy, run_engine

TOL = 1e-4  # measured max abs difference from HF: ~2e-5
K = 5


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode(PASSAGE * 2)[7:307]  # 300 tokens: one chunk at the 512 budget


@pytest.fixture(scope="module")
def chunked_engine(model_folder):
    """48-token steps: the 300-token prompt runs in 7 chunks."""
    return build_engine(EngineConfig(dtype="float32", num_kv_blocks=128,
                                     max_num_batched_tokens=48))


@pytest.fixture(scope="module")
def hf_logprobs(hf_model, prompt) -> torch.Tensor:
    """[P - 1, vocab]: row t is HF's log_softmax at position t, which scores token t + 1."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)


def _scored(engine, prompt: list[int], tag: str, k: int = K) -> Request:
    req = Request(tag, prompt, greedy(1, prompt_logprobs=k))
    run_engine(engine, [req])
    return req


def _assert_matches_hf(got: list[PromptLogprob], hf: torch.Tensor, prompt: list[int]) -> None:
    assert len(got) == len(prompt) - 1
    want = hf.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    logprobs = torch.tensor([e.logprob for e in got])
    assert (logprobs - want).abs().max().item() < TOL
    # Ranks and top ids up to ties within TOL (HF's own rounding could order those either way).
    ranks = torch.tensor([e.rank for e in got])
    assert ((hf > want[:, None] + TOL).sum(-1) + 1 <= ranks).all()
    assert (ranks <= (hf >= want[:, None] - TOL).sum(-1)).all()
    top_values = hf.topk(K, -1).values
    for row, e in enumerate(got):
        ids, values = zip(*e.top, strict=True)
        assert torch.allclose(torch.tensor(values), top_values[row], atol=TOL)
        assert torch.allclose(hf[row, list(ids)], torch.tensor(values), atol=TOL)


def test_prompt_logprobs_match_hf(engine_f32, prompt, hf_logprobs):
    req = _scored(engine_f32, prompt, "one-chunk")
    _assert_matches_hf(req.prompt_logprobs, hf_logprobs, prompt)
    assert req.prompt_logprobs[0].rank > 1  # a real prompt: not every token the likeliest


def test_chunked_prompt_scores_as_one_chunk(engine_f32, chunked_engine, prompt, hf_logprobs):
    chunked = _scored(chunked_engine, prompt, "chunked").prompt_logprobs
    _assert_matches_hf(chunked, hf_logprobs, prompt)
    whole = _scored(engine_f32, prompt, "whole").prompt_logprobs
    assert [e.logprob for e in chunked] == pytest.approx([e.logprob for e in whole], abs=1e-5)


def test_a_cached_prompt_is_scored_in_full(engine_f32, prompt, hf_logprobs):
    plain = Request("warm", prompt, greedy(1))
    run_engine(engine_f32, [plain])
    again = Request("again", prompt, greedy(1))
    run_engine(engine_f32, [again])
    assert again.num_cached_tokens > 0  # the cache holds the prompt ...
    req = _scored(engine_f32, prompt, "cached")
    assert req.num_cached_tokens == 0  # ... but a request asking for logprobs computes it
    _assert_matches_hf(req.prompt_logprobs, hf_logprobs, prompt)


def test_only_asking_requests_add_logits_rows(engine_f32, prompt, monkeypatch):
    model, rows = engine_f32.runner.model, []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda batch, cache: (
        rows.append(len(batch.logits_index)), forward(batch, cache))[1])
    run_engine(engine_f32, [Request("plain", prompt[:40], greedy(2)),
                            Request("asks", prompt[40:80], greedy(2, prompt_logprobs=0))])
    # Both prefilled in one step (2 sampled rows, 39 scoring the second prompt), then a
    # decode step of two rows: nothing more.
    assert rows == [2 + 39, 2]


def test_spans_cover_each_token_once():
    req = Request("r", list(range(100)), greedy(1, prompt_logprobs=0))
    first = span(req, 0, 48, 5)  # flat rows 5..52 score tokens 1..48
    assert (first.targets, first.first_row) == (range(1, 49), 5)
    last = span(req, 96, 4, 10)  # the last row (position 99) is the sampled one
    assert (last.targets, last.first_row) == (range(97, 100), 10)
    # Recomputed after a preemption: what was scored is not scored again.
    req.prompt_logprobs = [PromptLogprob(0.0, 1)] * 60
    assert span(req, 48, 48, 0).targets == range(61, 97)
    req.prompt_logprobs = [PromptLogprob(0.0, 1)] * 99
    assert span(req, 96, 4, 0) is None
    assert span(Request("no", list(range(100)), greedy(1)), 0, 48, 0) is None
