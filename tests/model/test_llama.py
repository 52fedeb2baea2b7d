"""The paged Llama forward against HF transformers on the embedded model, float32: greedy
tokens identical (up to near-ties) through the engine, alone and batched; logits close."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.request import Request
from pdserve.model.kv_cache import KVCache
from pdserve.model.llama import Batch, Chunk, DecodeGroup
from tests.utils import PASSAGE, assert_matches_reference, greedy, run_engine

NEW_TOKENS = 24
# Lengths that cover: under one block, exactly one block (16), several blocks, just over
# the 512-token step budget (chunked prefill), and about 1000 tokens.
LENGTHS = [5, 11, 16, 48, 130, 513, 700, 1000]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(PASSAGE * 8)
    assert len(ids) > max(LENGTHS)
    # Start each prompt elsewhere in the text, so they differ beyond their length.
    return [ids[i * 37:i * 37 + n] for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def references(prompts, hf_reference):
    return [hf_reference(p, NEW_TOKENS) for p in prompts]


def _requests(prompts: list[list[int]], tag: str) -> list[Request]:
    return [Request(f"{tag}{i}", p, greedy(NEW_TOKENS)) for i, p in enumerate(prompts)]


def test_greedy_one_at_a_time_matches_hf(engine_f32, prompts, references):
    for req, ref in zip(_requests(prompts, "solo"), references, strict=True):
        got = run_engine(engine_f32, [req])[req.request_id].token_ids
        assert_matches_reference(got, ref, f"{req.num_prompt_tokens}-token prompt")


def test_greedy_concurrent_batch_matches_hf(engine_f32, prompts, references):
    # One batch mixes decodes with prefill chunks cut at the step budget.
    reqs = _requests(prompts, "batch")
    gens = run_engine(engine_f32, reqs)
    for req, ref in zip(reqs, references, strict=True):
        assert_matches_reference(gens[req.request_id].token_ids, ref,
                                 f"{req.num_prompt_tokens}-token prompt in a batch")


def _forward(model, cache: KVCache, ids: list[int], start: int, table: list[int],
             decode: bool) -> torch.Tensor:
    """Logits of every token in ids (positions start..), the way the runner batches them:
    a chunk that reads earlier tokens from the cache, or a single-token decode."""
    bs = cache.shape.block_size
    n, end = len(ids), start + len(ids)
    pos = torch.arange(start, end)
    blocks = torch.tensor(table)[pos // bs]
    used = torch.tensor([table[:-(-end // bs)]])
    batch = Batch(torch.tensor(ids), pos, blocks, pos % bs, torch.arange(n))
    if decode:
        assert n == 1
        batch.decodes = [DecodeGroup.build([0], used, [end])]
    else:
        batch.chunks = [Chunk(0, n, start, used)]
    return model.forward(batch, cache)


@pytest.mark.parametrize("attention", ["paged kernels", "gather"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_logits_match_hf(engine_f32, hf_model, prompts, layout, attention, monkeypatch):
    """Per-token logits within atol 1e-3 (measured max abs diff ~5e-5) over all three
    attention cases: a first chunk, a chunk after cached tokens, and decodes (through the
    paged kernels, and through the gather + torch attention fallbacks)."""
    model, ids = engine_f32.runner.model, prompts[4][:90]
    assert model.paged is not None
    if attention == "gather":
        monkeypatch.setattr(model, "paged", None)
    cache = KVCache(model.config.kv_shape(16, layout), 12, torch.float32)
    table = [7, 2, 10, 0, 5, 9]  # scattered blocks catch block-table mistakes
    logits = [_forward(model, cache, ids[:40], 0, table, decode=False),
              _forward(model, cache, ids[40:80], 40, table, decode=False)]
    logits += [_forward(model, cache, [t], 80 + i, table, decode=True)
               for i, t in enumerate(ids[80:])]
    with torch.inference_mode():
        want = hf_model(torch.tensor([ids])).logits[0].float()
    diff = (torch.cat(logits) - want).abs().max().item()
    assert diff < 1e-3, f"max abs logit difference {diff} ({layout})"
