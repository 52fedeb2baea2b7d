"""The engine's side of the connector contract: what it tells a connector, and what it does
with each kind of KVConnectorOutput (a scripted connector plays the other side; the real
one is in tests/kv_transfer/test_connector.py and end to end in tests/e2e/test_pd.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request, Status
from pdserve.engine.sampler import Sampler
from pdserve.kv_transfer.interface import KVConnector, KVConnectorOutput, Load, RemotePrefill
from pdserve.kv_transfer.params import FirstToken, KVParams
from pdserve.model.kv_cache import KVCache
from tests.utils import Generation, assert_idle, collect, greedy, run_engine

PROMPT = list(range(100, 140))  # 40 tokens: 3 blocks of 16
PULL = KVParams(do_remote_prefill=True, remote_engine_id="p", remote_block_ids=[0, 1, 2],
                remote_host="127.0.0.1", remote_port=1)


class Scripted(KVConnector):
    """Answers as told and records what the engine told it."""

    def __init__(self, remote: RemotePrefill | None = None,
                 keep: tuple[bool, KVParams | None] = (False, None)) -> None:
        self.remote, self.keep = remote, keep
        self.next = KVConnectorOutput()
        self.loads: list[Load] = []
        self.finished: list[tuple] = []

    def on_new_request(self, request_id, params, num_prompt_tokens):
        return self.remote

    def start_loads(self, loads):
        self.loads += loads
        return KVConnectorOutput()

    def request_finished(self, request_id, params, block_ids, first_token):
        self.finished.append((request_id, list(block_ids), first_token))
        return self.keep

    def poll(self):
        out, self.next = self.next, KVConnectorOutput()
        return out

    def busy(self):
        return False

    def poll_interval(self):
        return 0.05

    def end_leases(self):
        pass

    def info(self):
        return []

    def close(self):
        pass


@pytest.fixture
def make(engine_f32):
    """An engine over the session engine's model (a cache of its own: the session engine's
    prefix cache must keep what it names), with a scripted connector."""
    def make(connector: Scripted) -> LLMEngine:
        cache = KVCache(engine_f32.runner.cache.shape, 32, torch.float32)
        runner = ModelRunner(engine_f32.runner.model, cache, Sampler(0))
        return LLMEngine(engine_f32.config, runner, engine_f32.tokenizer, connector)
    return make


def _loading(engine: LLMEngine, conn: Scripted, first: FirstToken | None) -> Request:
    conn.remote = RemotePrefill(True, first)
    req = Request("d1", PROMPT, greedy(4), PULL)
    out = engine.add_request(req)
    assert [o.new_token_ids for o in out] == ([[first.token_id]] if first else [])
    engine.step()
    assert req.status is Status.WAITING_FOR_REMOTE_KV
    assert conn.loads == [Load("d1", req.block_ids, 0)] and len(req.block_ids) == 3
    return req


@pytest.mark.parametrize("first", [FirstToken(7, -0.1), None])
def test_a_loaded_request_runs_from_its_first_token(make, first):
    conn = Scripted()
    engine = make(conn)
    req = _loading(engine, conn, first)
    conn.next = KVConnectorOutput(loaded=["d1"])
    engine.step()  # applies it, then schedules the request in the same step
    assert req.status is Status.RUNNING
    # Without a first token, the last prompt token ran here to sample one.
    assert req.num_computed_tokens == len(PROMPT) + 1 - (first is None)
    assert req.num_output_tokens == (2 if first else 1)
    engine.abort_request("d1")
    assert_idle(engine)


@pytest.mark.parametrize("windowed", [False, True])
def test_a_windowed_pull_keeps_its_blocks_out_of_the_prefix_cache(make, windowed):
    """Blocks whose sliding layers were not pulled (before their window) must not serve
    another request's prefix: they lack those layers' K/V."""
    conn = Scripted()
    engine = make(conn)
    assert engine.allocator.prefix_caching
    req = _loading(engine, conn, FirstToken(7, -0.1))
    conn.next = KVConnectorOutput(loaded=["d1"], windowed={"d1"} if windowed else set())
    engine.step()
    assert req.num_registered_blocks == (0 if windowed else len(PROMPT) // 16)
    engine.abort_request("d1")
    assert_idle(engine)


def test_a_recomputed_request_answers_as_if_never_remote(make, engine_f32):
    want = run_engine(engine_f32, [Request("mono", PROMPT, greedy(4))])["mono"]
    conn = Scripted()
    engine = make(conn)
    req = _loading(engine, conn, None)
    conn.next = KVConnectorOutput(recompute=["d1"])
    gen = Generation()
    while engine.has_work():
        collect({"d1": gen}, engine.step())
    assert gen.token_ids == want.token_ids and not req.load_remote
    assert_idle(engine)


def test_a_failed_request_ends_with_the_error_and_its_blocks_free(make):
    conn = Scripted()
    engine = make(conn)
    _loading(engine, conn, FirstToken(7, -0.1))
    conn.next = KVConnectorOutput(failed={"d1": "KV read from 127.0.0.1:1 timed out"})
    (out,) = engine.step()
    assert (out.finish_reason, out.error) == ("error", "KV read from 127.0.0.1:1 timed out")
    assert conn.finished[-1][0] == "d1" and conn.finished[-1][2] is None  # not completed
    assert_idle(engine)


def test_blocks_the_connector_keeps_come_back_through_free_blocks(make):
    answer = KVParams.for_decode("me", "127.0.0.1", 5600, "p1", [0], 1, FirstToken(0, 0.0))
    conn = Scripted(keep=(True, answer))
    engine = make(conn)
    req = Request("p1", PROMPT, greedy(1), KVParams(do_remote_decode=True))
    outs = engine.add_request(req)
    while engine.has_work():
        outs += engine.step()
    (rid, blocks, first), = conn.finished
    assert rid == "p1" and len(blocks) == 3
    assert first == FirstToken(req.output_token_ids[0], req.output_logprobs[0], [])
    assert outs[-1].kv_transfer_params is answer
    total = engine.allocator.num_blocks
    assert engine.allocator.num_free == total - 3  # held for the remote decode
    conn.next = KVConnectorOutput(free_blocks=blocks)
    engine.step()
    assert_idle(engine)
