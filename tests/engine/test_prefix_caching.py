"""Prefix caching: a request starts at the longest cached prefix of its tokens, never writes
a shared block, gives cached blocks back when it cannot be admitted; on the real engine the
output is the same with and without the cache, and fewer prompt tokens are computed."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from pdserve.config import EngineConfig
from pdserve.engine.build import build_engine
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import Request, Status
from tests.engine.test_scheduler import _add, _finish, _items, _scheduler, _step
from tests.utils import PASSAGE, greedy, run_engine


def _computed_then_finished(s, request_id: str, num_tokens: int) -> list[int]:
    req = _add(s, request_id, num_tokens)
    _step(s)
    blocks = list(req.block_ids)
    _finish(s, req)
    return blocks


def test_a_request_starts_at_its_cached_prefix():
    s = _scheduler(20, prefix_caching=True)
    a_blocks = _computed_then_finished(s, "a", 40)  # 2 full blocks of 16 and 8 tokens
    b = _add(s, "b", 40)
    sched = _step(s)
    assert _items(sched) == {"b": 8} and b.num_cached_tokens == 32
    assert b.block_ids[:2] == a_blocks[:2] and b.block_ids[2] != a_blocks[2]
    assert (sched.cache_queries, sched.cache_hits) == (40, 32)
    c = _add(s, "c", 40, first=1)  # other tokens from the first one on: no hit
    assert _items(_step(s)) == {"b": 1, "c": 40} and c.num_cached_tokens == 0


def test_the_block_of_the_last_prompt_token_is_never_shared():
    s = _scheduler(20, prefix_caching=True)
    a_blocks = _computed_then_finished(s, "a", 48)  # exactly 3 full blocks
    b = _add(s, "b", 48)
    # Its last token must run (for the next token's logits) and would write block 3.
    assert _items(_step(s)) == {"b": 16} and b.block_ids[:2] == a_blocks[:2]
    assert b.block_ids[2] not in a_blocks


def test_a_remote_prefilled_request_shares_every_full_prompt_block():
    s = _scheduler(20, prefix_caching=True)
    a_blocks = _computed_then_finished(s, "a", 48)
    b = _add(s, "b", 48)
    b.load_remote = True
    b.token_ids.append(7)  # the prefill's first token: the first one run here
    sched = _step(s)
    assert sched.to_load == [b] and b.block_ids == a_blocks and b.num_cached_tokens == 48
    s.loaded(b, ok=False)  # a failed pull recomputes only what the cache lacks
    assert b.status is Status.WAITING and b.num_computed_tokens == 48


def test_a_request_that_cannot_be_admitted_gives_its_cached_blocks_back():
    s = _scheduler(5, prefix_caching=True)
    a_blocks = _computed_then_finished(s, "a", 32)  # 2 blocks, cached and free
    big = _add(s, "big", 32, first=100)  # takes the 3 uncached blocks, one step after another
    assert _items(_step(s)) == {"big": 32}
    _add(s, "b", 40)  # hits a's 2 blocks but needs a third: none left
    assert _items(_step(s)) == {"big": 1}
    assert s.allocator.num_free == 2 and s.waiting[0].block_ids == []
    _finish(s, big)
    b = s.waiting[0]
    assert _items(_step(s)) == {"b": 8} and b.block_ids[:2] == a_blocks


# -- the real engine ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_no_cache(model_folder) -> LLMEngine:
    return build_engine(EngineConfig(dtype="float32", num_kv_blocks=64,
                                  enable_prefix_caching=False))


def test_cache_hits_change_no_output_and_cut_computed_prompt_tokens(tokenizer,
                                                                    engine_no_cache):
    ids = tokenizer.encode(PASSAGE)
    shared = ids[:70]
    prompts = [shared + ids[100:110], shared + ids[120:125], shared]
    registry = CollectorRegistry()
    cached = build_engine(EngineConfig(dtype="float32", num_kv_blocks=64), registry=registry)

    def run(engine: LLMEngine) -> list[list[int]]:
        out = [run_engine(engine, [Request("warm", prompts[0], greedy(12))])["warm"].token_ids]
        gens = run_engine(engine, [Request(f"r{i}", p, greedy(12))
                                   for i, p in enumerate(prompts)])
        return out + [gens[f"r{i}"].token_ids for i in range(len(prompts))]

    assert run(cached) == run(engine_no_cache)

    def value(name: str) -> float:
        return registry.get_sample_value(name, {"engine_id": cached.engine_id})

    # The warm-up caches its 5 full prompt blocks; the 4 that hold only shared tokens
    # serve every later prompt (r0 does not share its 5th: its last token runs there).
    hits = 3 * 64
    assert value("pdserve_prefix_cache_hits_total") == hits
    assert value("pdserve_prefix_cache_queries_total") == 80 + 80 + 75 + 70
    total = value("pdserve_prompt_tokens_total")
    assert value("pdserve_prompt_tokens_computed_total") == total - hits
