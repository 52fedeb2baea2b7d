"""The padded decode path that CUDA graphs replay, run eagerly on CPU: bucket choice, padding
rows that change no real row, the static buffers refilled between steps of other shapes, and
whole generations through the engine equal to the unpadded engine's, token for token."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.decode_graphs import DecodeGraphs, Decodes, batch_sizes, bucket, widths
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request, SamplingParams
from pdserve.engine.sampler import Sampler
from pdserve.model.kv_cache import KVCache
from tests.utils import greedy, run_engine

BLOCKS = 64


def test_batch_sizes_and_widths():
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_sizes(50) == [1, 2, 4, 8, 16, 32, 48, 50]
    assert batch_sizes(3) == [1, 2, 3]
    assert batch_sizes(1000)[-1] == 512
    assert widths(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert widths(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert widths(1) == [1]
    sizes = batch_sizes(64)
    assert [bucket(sizes, n) for n in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 32, 64]


def test_decodes_rows():
    d = Decodes()
    d.add(11, 16, [5, 6, 7], 16)  # the 17th token: block 6, offset 0, two blocks needed
    d.add(12, 3, [9, 4], 16)
    assert (d.ids, d.positions, d.blocks, d.offsets, d.lens) == (
        [11, 12], [16, 3], [6, 9], [0, 3], [17, 4])
    assert d.tables == [[5, 6], [9]] and d.width == 2


@pytest.fixture
def setup(engine_f32):
    """A prefilled cache of four sequences of different lengths, and their next tokens."""
    model = engine_f32.runner.model
    cache = KVCache(engine_f32.runner.cache.shape, BLOCKS, torch.float32)
    runner = ModelRunner(model, cache, Sampler(0))
    rng = random.Random(3)
    reqs, blocks = [], iter(range(BLOCKS - 1))
    for i, n in enumerate((5, 40, 17, 70)):
        req = Request(f"r{i}", [rng.randrange(1000) for _ in range(n)],
                      SamplingParams(max_tokens=8, temperature=0.0))
        req.block_ids = [next(blocks) for _ in range(-(-(n + 8) // 16))]
        runner.run([(req, n)])
        req.num_computed_tokens = n
        req.token_ids.append(rng.randrange(1000))
        reqs.append(req)
    return model, cache, runner, reqs


def _rows(reqs: list[Request]) -> Decodes:
    d = Decodes()
    for r in reqs:
        d.add(r.token_ids[-1], r.num_computed_tokens, r.block_ids, 16)
    return d


def _graphs(model, cache) -> DecodeGraphs:
    return DecodeGraphs(model, cache, 8, 8, scratch=BLOCKS - 1, capture=False)


def test_padding_rows_change_no_real_row(setup):
    model, cache, _, reqs = setup
    graphs = _graphs(model, cache)
    padded = graphs.run(_rows(reqs[:3]))  # three rows padded to four
    full = graphs.run(_rows(reqs))  # the fourth a real sequence
    assert padded.shape[0] == 3
    assert torch.equal(padded, full[:3])
    assert not torch.equal(full[3], full[2])


def test_static_buffers_refilled_between_shapes(setup):
    """Steps of 4, 1, 3, 4 and 1 rows, tables 1 to 5 blocks wide: each step's logits are the
    unpadded forward's (within float32 GEMM rounding), whatever the last step left behind."""
    model, cache, runner, reqs = setup
    graphs = _graphs(model, cache)
    for group in (reqs, reqs[1:2], reqs[:1] + reqs[2:], reqs[::-1], reqs[:1]):
        batch, _, _ = runner.prepare([(r, 1) for r in group])
        want = model.forward(batch, cache)
        got = graphs.run(_rows(group))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)  # GEMM rounding
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_the_scratch_block_is_not_allocated(engine_f32):
    cache = KVCache(engine_f32.runner.cache.shape, BLOCKS, torch.float32)
    runner = ModelRunner(engine_f32.runner.model, cache, Sampler(0),
                         _graphs(engine_f32.runner.model, cache))
    engine = LLMEngine(engine_f32.config, runner, engine_f32.tokenizer)
    assert engine.allocator.num_blocks == BLOCKS - 1


def test_generations_match_the_unpadded_engine(engine_f32):
    """Greedy generations of requests of different lengths, run together, through the padded
    decode path and through the plain one: the same tokens and logprobs; the pool whole."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (3, 30, 15, 60, 9)]
    outputs = []
    for padded in (False, True):
        cache = KVCache(engine_f32.runner.cache.shape, BLOCKS, torch.float32)
        graphs = _graphs(engine_f32.runner.model, cache) if padded else None
        runner = ModelRunner(engine_f32.runner.model, cache, Sampler(0), graphs)
        engine = LLMEngine(engine_f32.config, runner, engine_f32.tokenizer)
        gens = run_engine(engine, [Request(f"r{i}", p, greedy(12 + 3 * i, ignore_eos=True))
                                   for i, p in enumerate(prompts)])
        outputs.append([(g.token_ids, g.logprobs) for g in gens.values()])
        assert bool(cache.tensor[BLOCKS - 1].any()) == padded  # padding rows wrote there
    assert [len(t) for t, _ in outputs[1]] == [12, 15, 18, 21, 24]
    assert [t for t, _ in outputs[0]] == [t for t, _ in outputs[1]]
    for (_, want), (_, got) in zip(*outputs, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
