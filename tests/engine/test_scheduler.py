"""Continuous batching: chunked prefill, preemption when blocks run out, aborts, max_num_seqs.
The scheduler alone where the token arithmetic matters, the real engine where outputs do."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from pdserve.config import EngineConfig
from pdserve.engine.block_allocator import BlockAllocator
from pdserve.engine.build import build_engine
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import Request, SamplingParams, Status
from pdserve.engine.scheduler import Schedule, Scheduler
from tests.utils import PASSAGE, assert_idle, assert_matches_reference, greedy, run_engine

# -- the scheduler alone ---------------------------------------------------------------------


def _scheduler(num_blocks: int, prefix_caching: bool = False, **config) -> Scheduler:
    # Off unless a test is about it: the prompts below share prefixes (range(n)).
    return Scheduler(EngineConfig(**config), BlockAllocator(num_blocks, prefix_caching))


def _add(s: Scheduler, request_id: str, num_tokens: int, first: int = 0) -> Request:
    req = Request(request_id, list(range(first, first + num_tokens)), SamplingParams())
    s.add(req)
    return req


def _step(s: Scheduler) -> Schedule:
    """What the engine does with a schedule, minus the model: the scheduled tokens are
    computed, and a request whose known tokens are all computed samples one more."""
    sched = s.schedule()
    for req, n in sched.items:
        req.num_computed_tokens += n
        s.cache_computed(req)
        if req.num_computed_tokens == len(req.token_ids):
            req.token_ids.append(0)
    return sched


def _items(sched: Schedule) -> dict[str, int]:
    return {r.request_id: n for r, n in sched.items}


def _finish(s: Scheduler, req: Request) -> None:
    s.remove(req)
    s.allocator.free(req.block_ids)
    req.block_ids = []


def test_long_prompt_prefills_in_budget_chunks_that_stop_at_its_end():
    s = _scheduler(200, max_num_batched_tokens=512)
    a, b = _add(s, "a", 1300), _add(s, "b", 100)
    assert _items(_step(s)) == {"a": 512}
    assert len(a.token_ids) == 1300 and len(a.block_ids) == 32  # no sample mid-prompt
    assert _items(_step(s)) == {"a": 512}
    # a's last chunk ends at its prompt, though budget is left: b gets the rest.
    assert _items(_step(s)) == {"a": 276, "b": 100}
    assert len(a.token_ids) == 1301 and len(b.token_ids) == 101
    assert _items(_step(s)) == {"a": 1, "b": 1}


def test_preempted_request_recomputes_its_prompt_then_its_output():
    s = _scheduler(3, block_size=16)
    a, b = _add(s, "a", 16), _add(s, "b", 16)
    assert _items(_step(s)) == {"a": 16, "b": 16}
    # a's 17th token takes the last free block, so b (the newest) is preempted, then
    # readmitted with its freed block for the prompt only, not its sampled token.
    sched = _step(s)
    assert sched.preempted == [b] and _items(sched) == {"a": 1, "b": 16}
    assert b.num_computed_tokens == 16 and len(b.output_token_ids) == 1
    _finish(s, a)
    assert _items(_step(s)) == {"b": 1}
    assert len(b.output_token_ids) == 2 and s.allocator.num_free == 1


def test_a_preempted_remote_prefilled_request_is_recomputed_not_pulled_again():
    """Its pull ended when it first ran; once preempted its KV is gone with its blocks
    (seen on a GPU decode under load: the engine asked the connector for a finished pull)."""
    s = _scheduler(3, block_size=16)
    a = _add(s, "a", 16)
    assert _items(_step(s)) == {"a": 16}
    b = _add(s, "b", 15)
    b.load_remote = True  # as the connector marks a remote-prefilled request
    assert s.admit_loads().to_load == [b]
    s.loaded(b, ok=True)  # the pull landed
    b.token_ids.append(0)  # the prefill's first token
    assert _items(_step(s)) == {"a": 1, "b": 1}
    # b's 17th token needs a block: none is left and b is the newest, so it is preempted,
    # then readmitted with its freed block and recomputed here, prompt first: no pull.
    sched = _step(s)
    assert sched.preempted == [b] and _items(sched) == {"a": 1, "b": 15}
    assert not b.load_remote and not sched.to_load
    _finish(s, a)
    assert _items(_step(s)) == {"b": 2}  # then its output


def test_max_num_seqs_caps_the_running_set():
    s = _scheduler(100, max_num_seqs=2)
    reqs = [_add(s, f"r{i}", 10) for i in range(4)]
    assert _items(_step(s)) == {"r0": 10, "r1": 10}
    assert _items(_step(s)) == {"r0": 1, "r1": 1}
    _finish(s, reqs[0])
    assert _items(_step(s)) == {"r1": 1, "r2": 10}
    assert len(s.running) == 2 and [r.status for r in reqs[2:]] == [Status.RUNNING,
                                                                     Status.WAITING]


def test_admit_loads_takes_remote_kv_requests_at_the_head_only():
    s = _scheduler(100, max_num_seqs=3)
    remote = [_add(s, f"p{i}", 40) for i in range(2)]
    local = _add(s, "local", 10)
    late = _add(s, "late", 40)
    for req in (*remote, late):
        req.load_remote = True
    sched = s.admit_loads()
    # FIFO holds: the remote request queued behind a local prompt waits for schedule().
    assert sched.to_load == remote and not sched.items
    assert [len(r.block_ids) for r in remote] == [3, 3]
    assert list(s.waiting) == [local, late] and set(s.loading) == {"p0", "p1"}
    assert _items(_step(s)) == {"local": 10}  # max_num_seqs: late still waits
    s.loaded(remote[0], ok=True)
    assert s.admit_loads().to_load == [] and list(s.waiting) == [late]


# -- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(PASSAGE)
    return [ids[i * 50:i * 50 + 40] for i in range(4)]


def test_preemption_when_blocks_run_out(prompts, hf_reference):
    # 10 blocks of 16 tokens; each request needs 4 (40 + 24 tokens): not all fit at once.
    registry = CollectorRegistry()
    engine = build_engine(EngineConfig(dtype="float32", num_kv_blocks=10), registry=registry)
    reqs = [Request(f"p{i}", p, greedy(24)) for i, p in enumerate(prompts)]
    gens = run_engine(engine, reqs)  # asserts the pool is whole after
    assert registry.get_sample_value("pdserve_num_preemptions_total",
                                     {"engine_id": engine.engine_id}) > 0
    for i, p in enumerate(prompts):
        assert gens[f"p{i}"].finish_reason == "length"
        assert_matches_reference(gens[f"p{i}"].token_ids, hf_reference(p, 24), f"p{i}")


def _until(engine: LLMEngine, req: Request, stage: str) -> None:
    """Step until req is in `stage`: waiting (never scheduled), prefilling, decoding."""
    if stage == "waiting":
        return
    engine.step()
    if stage == "decoding":
        engine.step()
        assert req.num_output_tokens >= 1
    else:
        assert 0 < req.num_computed_tokens < req.num_prompt_tokens


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding"])
def test_abort_frees_every_block(engine_f32, prompts, hf_reference, stage):
    ids = (prompts[0] * 30)[:1100] if stage == "prefilling" else prompts[1]
    bystander = Request(f"by-{stage}", prompts[2], greedy(8))
    victim = Request(f"abort-{stage}", ids, greedy(100))
    engine_f32.add_request(bystander)
    engine_f32.add_request(victim)
    _until(engine_f32, victim, stage)
    out = engine_f32.abort_request(victim.request_id)
    assert out is not None and out.finish_reason == "abort" and out.finished
    assert engine_f32.abort_request(victim.request_id) is None  # already gone
    while engine_f32.has_work():
        engine_f32.step()
    assert_idle(engine_f32)
    assert_matches_reference(bystander.output_token_ids, hf_reference(prompts[2], 8))


def test_engine_respects_max_num_seqs(engine_f32, prompts, monkeypatch):
    monkeypatch.setattr(engine_f32.config, "max_num_seqs", 2)  # the scheduler reads it live
    reqs = [Request(f"seqs{i}", p[:10], greedy(4, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for r in reqs:
        engine_f32.add_request(r)
    peak = 0
    while engine_f32.has_work():
        engine_f32.step()
        peak = max(peak, len(engine_f32.scheduler.running))
    assert peak == 2 and all(r.num_output_tokens == 4 for r in reqs)
    assert_idle(engine_f32)


def test_a_request_without_prompt_tokens_is_refused_before_it_reaches_a_step():
    # Scheduled, it would make a step of zero tokens and fail every request batched with it.
    with pytest.raises(ValueError, match="no tokens"):
        Request("empty", [], SamplingParams(max_tokens=1))


def test_decodes_ride_outside_the_prompt_budget():
    """A prompt as long as the budget goes in one step beside running decodes (not in two,
    the second a sliver), and decodes go on while a long prompt spends whole budgets."""
    s = _scheduler(200, max_num_batched_tokens=512)
    d1, d2 = _add(s, "d1", 10), _add(s, "d2", 10)
    assert _items(_step(s)) == {"d1": 10, "d2": 10}
    p = _add(s, "p", 512)
    assert _items(_step(s)) == {"d1": 1, "d2": 1, "p": 512}
    _finish(s, d1)
    _finish(s, d2)
    _add(s, "long", 1200)
    assert _items(_step(s)) == {"p": 1, "long": 512}
    later = _add(s, "later", 8)
    assert _items(_step(s)) == {"p": 1, "long": 512}  # the budget spent: "later" waits
    assert _items(_step(s)) == {"p": 1, "long": 176, "later": 8}
    assert _items(_step(s)) == {"p": 1, "long": 1, "later": 1}
    assert later.status is Status.RUNNING and p.num_output_tokens == 5
