"""Sampling: greedy, seeds, top-k/top-p truncation, temperature, penalties, logprobs and top
logprobs; penalties and logprobs on the embedded model against HF transformers."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.request import Request, SamplingParams
from pdserve.engine.sampler import (
    Sampler,
    _greedy_picks,
    _torch_greedy,
    _truncate,
    apply_penalties,
)
from tests.utils import assert_matches_reference, greedy, hf_penalised_greedy, run_engine

VOCAB = 1000


def _reqs(n: int, **params) -> list[Request]:
    return [Request(f"r{i}", [1], SamplingParams(**params)) for i in range(n)]


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_its_logprob():
    logits = _logits(8)
    tokens, logprobs, _ = Sampler().sample(logits.clone(), _reqs(8, temperature=0.0))
    assert tokens == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits, -1)[torch.arange(8), logits.argmax(-1)]
    assert logprobs == pytest.approx(want.tolist(), abs=1e-5)


def test_greedy_takes_the_first_of_equal_maxima():
    logits = torch.zeros(3, VOCAB)
    logits[0, [7, 3, 900]] = 1.0
    logits[1, [500, 2]] = 5.0
    tokens, _, _ = Sampler().sample(logits, _reqs(3, temperature=0.0))
    assert tokens == [3, 2, 0]


def test_greedy_kernel_agrees_with_torch():
    """Plain greedy batches take the C++ kernel: ties across lanes and in the tail give
    torch's tokens, with log_softmax's logprobs; rows it cannot decide (NaN, all -inf, +inf)
    leave the batch to torch."""
    logits = _logits(4)
    logits[0, [995, 999]] = 50.0  # equal maxima in the tail (VOCAB is no multiple of 16)
    logits[1, [33, 18, 17]] = 50.0  # the same lane, then another lane
    picked = _greedy_picks(logits, _reqs(4, temperature=0.0))
    assert picked is not None
    assert picked[0] == logits.max(-1).indices.tolist()
    assert picked[0][:2] == [995, 17]
    want = torch.log_softmax(logits, -1)[torch.arange(4), logits.max(-1).indices]
    assert picked[1] == pytest.approx(want.tolist(), abs=1e-5)
    for row in (torch.where(torch.arange(VOCAB) == 7, float("nan"), logits[3]),
                torch.full((VOCAB,), float("-inf")),
                torch.where(torch.arange(VOCAB) == 7, float("inf"), logits[3])):
        odd = torch.cat((logits[:3], row[None]))
        assert _greedy_picks(odd, _reqs(4, temperature=0.0)) is None
        tokens, _, _ = Sampler().sample(odd.clone(), _reqs(4, temperature=0.0))
        assert tokens == odd.max(-1).indices.tolist()


def test_greedy_on_the_device_agrees_with_the_kernel():
    """The picks made where the logits are (accelerators; torch ops, run here on CPU): the
    kernel's tokens and logprobs, and NaN for the rows the kernel leaves to torch."""
    logits = _logits(6)
    logits[0, [995, 999]] = 50.0
    logits[1, [33, 18, 17]] = 50.0
    logits[3, 7] = float("nan")
    logits[4] = float("-inf")
    logits[5, 7] = float("inf")
    tokens, logprobs = _torch_greedy(logits)
    kernel = _greedy_picks(logits[:3], _reqs(3, temperature=0.0))
    assert tokens[:3].tolist() == kernel[0] == [995, 17, logits[2].argmax().item()]
    assert logprobs[:3].tolist() == pytest.approx(kernel[1], abs=1e-5)
    assert logprobs[3:].isnan().all()


# top_p 1e-300 is 0 in float32: the nucleus keeps the likeliest token still (it once kept
# none, and sampled a token past the vocabulary).
@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"top_p": 1e-300}],
                         ids=["top_k=1", "top_p=1e-6", "top_p=1e-300"])
def test_truncation_to_one_token_is_greedy(params):
    logits = _logits(32)
    tokens, *_ = Sampler(seed=7).sample(logits.clone(), _reqs(32, temperature=1.5, **params))
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
    tokens, *_ = Sampler(seed=0).sample(logits.expand(n, -1).clone(), _reqs(n, **params))
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


def _truncate_by_sorting(logits, top_k, top_p):
    """The definition: sort each row, keep top_k, then the smallest prefix reaching top_p."""
    out = torch.full_like(logits, float("-inf"))
    for row, (x, k, p) in enumerate(zip(logits, top_k, top_p, strict=True)):
        values, order = x.sort(descending=True)
        values = values[:k] if k > 0 else values
        probs = torch.softmax(values, -1)
        keep = int(((probs.cumsum(-1) - probs) < p).sum()) if p < 1 else len(values)
        out[row, order[:keep]] = values[:keep]
    return out


def test_truncation_keeps_what_a_full_sort_keeps():
    # Peaked rows (small nuclei), flat ones (a top_p nucleus far wider than the 16 tokens
    # looked at first, so those rows take the sort) and top_k past that width.
    logits = torch.cat([_logits(4, seed=1) * 4, _logits(4, seed=2) * 0.05])
    top_k = [0, 5, 0, 300, 0, 0, 2, 100]
    top_p = [0.9, 0.5, 1.0, 0.95, 0.9, 0.5, 1.0, 1.0]
    got = _truncate(logits, top_k, top_p, width=16)
    want = _truncate_by_sorting(logits, top_k, top_p)
    assert torch.equal(got.isfinite(), want.isfinite())
    assert torch.equal(got[got.isfinite()], want[want.isfinite()])
    assert (got.isfinite().sum(-1) > 300).any(), "no row took the full sort"


def test_logprob_is_the_models_not_the_tempered_one():
    tokens, logprobs, _ = Sampler().sample(LOGITS.expand(64, -1).clone(),
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


def _history(prompt: list[int], output: list[int], **params) -> Request:
    req = Request("h", prompt, SamplingParams(**params))
    req.token_ids += output
    return req


PENALTIES = [{"repetition_penalty": 1.3}, {"repetition_penalty": 0.7},
             {"presence_penalty": 0.8, "frequency_penalty": 0.5},
             {"presence_penalty": -1.0, "frequency_penalty": -0.3, "repetition_penalty": 1.2}]


def test_penalties_match_hf_processor_and_openai_formulas():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = _logits(len(PENALTIES) + 1)
    g = torch.Generator().manual_seed(1)
    reqs = [_history(torch.randint(0, 50, (12,), generator=g).tolist(),
                     torch.randint(0, 50, (9,), generator=g).tolist(), **p)
            for p in [*PENALTIES, {}]]  # the last row has none: left as it was
    got = apply_penalties(logits.clone(), reqs)
    for row, req in enumerate(reqs):
        p = req.params
        ids = torch.tensor([req.token_ids])
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, logits[row:row + 1])
        counts = torch.bincount(torch.tensor(req.output_token_ids), minlength=VOCAB)
        want = want[0] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        torch.testing.assert_close(got[row], want, atol=1e-5, rtol=0)  # float32 rounding
    assert torch.equal(got[-1], logits[-1])


def test_greedy_follows_the_penalties_logprob_stays_raw():
    logits = _logits(2)
    top = logits.argmax(-1).tolist()
    # Seen in the output, the top token is pushed far down: greedy must pick another.
    reqs = [_history([1], [t], temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0,
                     repetition_penalty=50.0) for t in top]
    tokens, logprobs, _ = Sampler().sample(logits.clone(), reqs)
    assert tokens == apply_penalties(logits.clone(), reqs).argmax(-1).tolist()
    assert all(t != old for t, old in zip(tokens, top, strict=True))
    raw = torch.log_softmax(logits, -1)
    assert logprobs == pytest.approx([raw[i, t].item() for i, t in enumerate(tokens)],
                                     abs=1e-6)


def test_top_logprobs_per_row():
    logits = _logits(3)
    reqs = [Request(f"r{k}", [1], SamplingParams(temperature=0.0, logprobs=True,
                                                 top_logprobs=k)) for k in (0, 2, 5)]
    _, _, tops = Sampler().sample(logits.clone(), reqs)
    values, ids = torch.log_softmax(logits, -1).topk(5, -1)
    assert tops[0] == []
    for row, k in ((1, 2), (2, 5)):
        assert [t for t, _ in tops[row]] == ids[row, :k].tolist()
        assert [lp for _, lp in tops[row]] == pytest.approx(values[row, :k].tolist(), abs=1e-6)


@pytest.mark.parametrize("penalties", PENALTIES[:1] + PENALTIES[2:],
                         ids=["repetition", "presence+frequency", "all"])
def test_engine_penalties_match_hf(engine_f32, hf_model, tokenizer, penalties):
    # Repetitive text, so the penalties change the greedy continuation.
    ids = tokenizer.encode("one two three one two three one two three one two")
    req = Request("p", ids, greedy(12, ignore_eos=True, **penalties))
    got = run_engine(engine_f32, [req])["p"].token_ids
    ref = hf_penalised_greedy(hf_model, ids, 12, penalties.get("repetition_penalty", 1.0),
                              penalties.get("presence_penalty", 0.0),
                              penalties.get("frequency_penalty", 0.0))
    plain = hf_penalised_greedy(hf_model, ids, 12)
    assert ref.tokens != plain.tokens, "the penalties must change the reference"
    assert_matches_reference(got, ref, str(penalties))


def test_engine_logprobs_match_hf(engine_f32, hf_model, tokenizer):
    """Chosen and top-5 logprobs are log_softmax of the model's raw logits (float32; 2e-4
    absolute: another kernel's rounding), also with temperature and penalties."""
    ids = tokenizer.encode("The lighthouse keeper climbed the stairs")
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=True,
                            top_logprobs=5, repetition_penalty=1.2, ignore_eos=True)
    req = Request("l", ids, params)
    gen = run_engine(engine_f32, [req])["l"]
    with torch.inference_mode():
        seq = torch.tensor([ids + gen.token_ids])
        ref = torch.log_softmax(hf_model(seq).logits[0, len(ids) - 1:-1].float(), -1)
    chosen = ref.gather(1, torch.tensor(gen.token_ids)[:, None]).squeeze(1)
    assert gen.logprobs == pytest.approx(chosen.tolist(), abs=2e-4)
    assert len(req.output_top_logprobs) == len(gen.token_ids)
    for pos, top in enumerate(req.output_top_logprobs):
        assert len(top) == 5
        assert [lp for _, lp in top] == pytest.approx(ref[pos, [t for t, _ in top]].tolist(),
                                                      abs=2e-4)
        # They are the five most likely: HF's fifth best is no likelier than the last.
        assert ref[pos].topk(5).values[-1].item() <= top[-1][1] + 2e-4
