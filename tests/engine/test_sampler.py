"""Sampling: greedy, seeds, top-k/top-p truncation, temperature, logprobs."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.request import Request, SamplingParams
from pdserve.engine.sampler import Sampler
from tests.utils import run_engine

VOCAB = 1000


def _reqs(n: int, **params) -> list[Request]:
    return [Request(f"r{i}", [1], SamplingParams(**params)) for i in range(n)]


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_its_logprob():
    logits = _logits(8)
    tokens, logprobs = Sampler().sample(logits.clone(), _reqs(8, temperature=0.0))
    assert tokens == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits, -1)[torch.arange(8), logits.argmax(-1)]
    assert logprobs == pytest.approx(want.tolist(), abs=1e-5)


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}],
                         ids=["top_k=1", "top_p=1e-6"])
def test_truncation_to_one_token_is_greedy(params):
    logits = _logits(32)
    tokens, _ = Sampler(seed=7).sample(logits.clone(), _reqs(32, temperature=1.5, **params))
    assert tokens == logits.argmax(-1).tolist()


def test_seeded_requests_reproduce_and_seeds_differ():
    flat = torch.zeros(16, VOCAB)  # uniform: only the noise picks the token

    def draw(seed: int, sampler_seed: int) -> list[int]:
        return Sampler(sampler_seed).sample(flat.clone(), _reqs(16, seed=seed))[0]

    # A request's seed, not the engine's generator, decides its tokens.
    assert draw(1, sampler_seed=0) == draw(1, sampler_seed=99)
    assert draw(1, 0) != draw(2, 0)


def test_seeded_position_changes_the_draw():
    # The seed is mixed with the output position, so tokens are not one repeated draw.
    flat = torch.zeros(1, VOCAB)
    req = Request("r", [1], SamplingParams(seed=5))
    draws = []
    for _ in range(8):
        draws += Sampler().sample(flat.clone(), [req])[0]
        req.token_ids.append(draws[-1])
    assert len(set(draws)) > 1


def test_unseeded_sampling_follows_the_engine_seed():
    flat = torch.zeros(16, VOCAB)
    a = Sampler(3).sample(flat.clone(), _reqs(16))[0]
    assert a == Sampler(3).sample(flat.clone(), _reqs(16))[0]
    assert a != Sampler(4).sample(flat.clone(), _reqs(16))[0]


def _frequencies(logits: torch.Tensor, n: int, **params) -> torch.Tensor:
    tokens, _ = Sampler(seed=0).sample(logits.expand(n, -1).clone(), _reqs(n, **params))
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / n


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_follows_softmax(temperature):
    got = _frequencies(LOGITS, 20000, temperature=temperature)
    want = torch.softmax(LOGITS[0] / temperature, -1)
    assert torch.allclose(got, want, atol=0.015), (got, want)


def test_top_k_and_top_p_renormalise_what_they_keep():
    got = _frequencies(LOGITS, 20000, top_k=2)
    assert torch.allclose(got, torch.tensor([0.731, 0.269, 0, 0, 0]), atol=0.015)
    # The smallest prefix reaching 0.7 of the mass is tokens 0 and 1 (0.56 + 0.21).
    got = _frequencies(LOGITS, 20000, top_p=0.7)
    assert torch.allclose(got, torch.tensor([0.731, 0.269, 0, 0, 0]), atol=0.015)


def test_logprob_is_the_models_not_the_tempered_one():
    tokens, logprobs = Sampler().sample(LOGITS.expand(64, -1).clone(),
                                        _reqs(64, temperature=3.0, top_k=3))
    full = torch.log_softmax(LOGITS[0], -1)
    assert logprobs == pytest.approx([full[t].item() for t in tokens], abs=1e-5)


def test_engine_seeded_sampling_reproduces(engine_f32, tokenizer):
    ids = tokenizer.encode("Once upon a time")

    def run(seed: int, tag: str) -> list[int]:
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
        return run_engine(engine_f32, [Request(tag, ids, params)])[tag].token_ids

    first = run(11, "s1")
    assert run(11, "s2") == first
    assert run(12, "s3") != first
