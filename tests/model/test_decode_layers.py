"""A decode step's layers in one native call give the Python loop's bits: logits and cache."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.build import build_engine
from pdserve.model.kv_cache import KVCache
from pdserve.model.llama import Batch, Chunk, DecodeGroup, LlamaModel

BS = 16


@pytest.fixture(scope="module")
def model(model_folder) -> LlamaModel:
    m = build_engine(EngineConfig(dtype="bfloat16", num_kv_blocks=64)).runner.model
    if m.native is None:
        pytest.skip("no pair-packed bf16 products on this CPU (AVX512-BF16)")
    return m


def _prefilled(model: LlamaModel, prompts: list[list[int]]) -> KVCache:
    """A cache holding each prompt i in blocks [8 i, 8 i + 8), prefilled by the Python loop."""
    cache = KVCache(model.config.kv_shape(BS, "HND"), 8 * len(prompts), torch.bfloat16)
    for i, ids in enumerate(prompts):
        pos = torch.arange(len(ids))
        table = torch.arange(8 * i, 8 * i + 8)
        model.forward(Batch(torch.tensor(ids), pos, table[pos // BS], pos % BS,
                            torch.tensor([len(ids) - 1]),
                            chunks=[Chunk(0, len(ids), 0, table[None, :-(-len(ids) // BS)])]),
                      cache)
    return cache


def _decodes(tokens: list[int], lens: list[int]) -> Batch:
    """One decode per sequence i: tokens[i] at position lens[i] (sequence i's blocks as
    _prefilled's), rows in the order of their context as the runner groups them."""
    pos = torch.tensor(lens)
    blocks = torch.arange(len(lens)) * 8 + pos // BS
    width = max(n // BS + 1 for n in lens)
    tables = torch.stack([torch.arange(8 * i, 8 * i + width) for i in range(len(lens))])
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    return Batch(torch.tensor(tokens), pos, blocks, pos % BS, torch.arange(len(lens)),
                 decodes=[DecodeGroup.build(order, tables[order],
                                            [lens[i] + 1 for i in order])])


def _steps(model: LlamaModel, cache: KVCache, prompts: list[list[int]], n: int
           ) -> list[torch.Tensor]:
    """n greedy decode steps of every prompt at once: each step's logits."""
    lens, tokens, out = [len(p) for p in prompts], [p[-1] for p in prompts], []
    for _ in range(n):
        logits = model.forward(_decodes(tokens, lens), cache)
        out.append(logits)
        tokens, lens = logits.argmax(-1).tolist(), [x + 1 for x in lens]
    return out


@pytest.mark.parametrize("paused", [False, True], ids=["one call", "a call a layer"])
def test_native_layers_are_the_python_loops_bits(model, tokenizer, monkeypatch, paused):
    """Decode steps of sequences of unlike lengths (blocks partly filled, one crossing a
    block edge): logits and every cached K/V equal, bit for bit. With a checkpoint (a core
    loan) each layer is a call of its own, the checkpoint before it."""
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "A " * 30 + "cat",
                                             "Once upon a time, in a land far away, there")]
    cache, calls = _prefilled(model, prompts), []
    if paused:
        monkeypatch.setattr(model, "checkpoint", lambda: calls.append(1))
    twin = KVCache(cache.shape, cache.num_blocks, torch.bfloat16)
    twin.tensor.copy_(cache.tensor)
    native = _steps(model, cache, prompts, 4)
    assert len(calls) == (4 * model.config.num_layers if paused else 0)
    with monkeypatch.context() as m:
        m.setattr(model, "native", None)
        python = _steps(model, twin, prompts, 4)
    assert all(torch.equal(a, b) for a, b in zip(native, python, strict=True))
    assert torch.equal(cache.tensor, twin.tensor)


def test_other_steps_take_the_python_loop(model, tokenizer, monkeypatch):
    """Prefill chunks, and decode steps of more rows than the native call takes, run the
    Python loop."""
    def refuse(*args):
        raise AssertionError("a step the native layers do not take reached them")

    monkeypatch.setattr(model.native, "run", refuse)
    monkeypatch.setattr(model.native, "max_rows", 2)
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "Hello", "Why")]
    cache = _prefilled(model, prompts)
    _steps(model, cache, prompts, 1)
