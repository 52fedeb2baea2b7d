"""Scheduler-side bookkeeping of the P/D connector over a fake transport (the real NIXL
path is covered end to end in tests/e2e/test_pd.py)."""

from __future__ import annotations

import time
from concurrent.futures import wait
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from pdserve.config import EngineConfig, KVTransferConfig
from pdserve.engine.block_allocator import BlockAllocator, chain_hashes
from pdserve.engine.request import Request, RequestOutput, SamplingParams, Status
from pdserve.engine.scheduler import Scheduler
from pdserve.kv_transfer.base import Peer, Transport
from pdserve.kv_transfer.connector import PDConnector
from pdserve.kv_transfer.host_buffer import HostBuffer
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.platforms.cpu import CPU


class FakeTransport(Transport):
    def __init__(self) -> None:
        self.reads: list[SimpleNamespace] = []
        self.sent: list[bytes] = []
        self.inbox: list[bytes] = []
        self.engine_id = "prefill-a"
        self.refuse: Exception | None = None
        self.released: list[str] = []

    def connect(self, host, port):
        if self.refuse:
            raise self.refuse
        return Peer(host, port, self.engine_id, "agent", 100, {})

    def forget(self, peer):
        pass

    def read(self, peer, local_ids, remote_ids, notif):
        h = SimpleNamespace(local=local_ids, remote=remote_ids, notif=notif, state="PROC")
        self.reads.append(h)
        return h

    def poll(self, handle):
        return handle.state

    def handle_stats(self, handle):
        return len(handle.local) * 1000, 1

    def notify(self, peer, msg):
        self.sent.append(msg)

    def notifications(self):
        out, self.inbox = self.inbox, []
        return out

    def release(self, host, port, request_id):
        self.released.append(request_id)

    def info(self):
        return {"engine_id": "me", "side_channel_host": "127.0.0.1", "side_channel_port": 5600}

    def close(self):
        pass


class FakeEngine:
    """The parts of LLMEngine the connector uses."""

    def __init__(self, num_blocks: int = 16) -> None:
        self.config = EngineConfig(block_size=4, max_num_batched_tokens=64)
        self.allocator = BlockAllocator(num_blocks)
        self.scheduler = Scheduler(self.config, self.allocator)
        self.cache = SimpleNamespace(block_bytes=1000)
        self.tokenizer = SimpleNamespace(vocab_size=1000)
        self.failed: list[tuple[str, str]] = []

    def free_blocks(self, req):
        self.allocator.free(req.block_ids)
        req.block_ids = []

    def fail_request(self, req, error):
        self.failed.append((req.request_id, error))
        req.status = Status.FINISHED
        self.scheduler.remove(req)
        self.free_blocks(req)
        return RequestOutput(req.request_id, [], [], "", 0, 0, "error", error)


def make(policy: str = "recompute", staging: HostBuffer | None = None,
         **extra) -> tuple[PDConnector, FakeEngine, FakeTransport]:
    cfg = KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                      "kv_load_failure_policy": policy,
                                      "kv_connector_extra_config": extra})
    engine, transport = FakeEngine(), FakeTransport()
    conn = PDConnector(cfg, engine, transport, TransferMetrics(CollectorRegistry(), "e"),
                       "127.0.0.1", staging)
    return conn, engine, transport


def decode_request(rid: str = "d1", prompt_len: int = 10, **params) -> Request:
    p = {"do_remote_prefill": True, "remote_engine_id": "prefill-a",
         "remote_block_ids": [7, 8, 9], "remote_request_id": "p1",
         "remote_host": "127.0.0.1", "remote_port": 5600, "first_token_id": 42,
         "first_token_logprob": -0.5, **params}
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=5), p)


def finished_prefill(engine: FakeEngine, prompt_len: int) -> Request:
    """A do_remote_decode request that just sampled its one token (5, logprob -1)."""
    req = Request("p1", list(range(prompt_len)), SamplingParams(max_tokens=1),
                  {"do_remote_decode": True})
    req.block_ids = engine.allocator.allocate(-(-prompt_len // engine.config.block_size))
    req.token_ids.append(5)
    req.output_logprobs.append(-1.0)
    req.finish_reason = "length"
    return req


def settle(conn: PDConnector) -> list[RequestOutput]:
    """Let the handshake thread finish, then poll."""
    wait(list(conn.connecting.values()), timeout=5)
    return conn.poll()


def admit(conn: PDConnector, engine: FakeEngine, req: Request) -> None:
    assert conn.on_add(req) == (42, -0.5, [])
    req.token_ids.append(42)  # what the engine does with the first token
    engine.scheduler.add(req)
    sched = engine.scheduler.schedule()
    assert sched.to_load == [req] and req.status is Status.WAITING_FOR_REMOTE_KV
    conn.start_load(sched.to_load)


def test_pull_lands_and_request_runs_from_the_first_token():
    conn, engine, transport = make()
    req = decode_request()
    admit(conn, engine, req)
    settle(conn)
    (read,) = transport.reads
    assert read.remote == [7, 8, 9] and read.local == req.block_ids[:3]
    assert read.notif == b"done:p1"
    read.state = "DONE"
    conn.poll()
    assert req.status is Status.RUNNING and req.num_computed_tokens == 10
    assert conn.metrics.transfers._value.get() == 1 and not conn.pulls
    (req2, n), = engine.scheduler.schedule().items
    assert req2 is req and n == 1  # only the first token is computed here


def _cache_locally(engine: FakeEngine, tokens: list[int]) -> list[int]:
    """Blocks of `tokens` computed here before, now free but still in the prefix cache."""
    n = len(tokens) // engine.config.block_size
    blocks = engine.allocator.allocate(n)
    for block, h in zip(blocks, chain_hashes(tokens, engine.config.block_size, [], n),
                        strict=True):
        engine.allocator.cache(block, h)
    engine.allocator.free(blocks)
    return blocks


def test_blocks_in_the_local_prefix_cache_are_not_pulled_again():
    conn, engine, transport = make()
    cached = _cache_locally(engine, list(range(8)))
    req = decode_request()  # 10 prompt tokens: blocks 7, 8 (full) and 9 on the prefill
    admit(conn, engine, req)
    settle(conn)
    (read,) = transport.reads
    assert req.block_ids[:2] == cached and read.remote == [9] and read.local == req.block_ids[2:]
    assert conn.metrics.bytes_saved._value.get() == 2000
    read.state = "DONE"
    conn.poll()
    assert req.status is Status.RUNNING and req.num_computed_tokens == 10


def test_a_full_local_hit_pulls_nothing_and_tells_the_prefill():
    conn, engine, transport = make()
    cached = _cache_locally(engine, list(range(8)))
    req = decode_request(prompt_len=8, remote_block_ids=[7, 8])
    admit(conn, engine, req)
    settle(conn)
    assert not transport.reads and transport.sent == [b"done:p1"] and not conn.pulls
    assert req.block_ids == cached and req.status is Status.RUNNING
    assert req.num_computed_tokens == 8


def test_host_buffer_is_staged_in_before_the_request_runs():
    cache = torch.zeros(16, 2)
    staging = HostBuffer(CPU, cache, torch.arange(32.0).reshape(16, 2))
    conn, engine, transport = make(staging=staging)
    req = decode_request()
    admit(conn, engine, req)
    settle(conn)
    transport.reads[0].state = "DONE"
    conn.poll()
    ids = req.block_ids[:3]
    assert torch.equal(cache[ids], staging.host[ids]) and req.status is Status.RUNNING
    others = [i for i in range(16) if i not in ids]
    assert not cache[others].any()


def test_prefill_stages_out_before_announcing():
    cache = torch.arange(32.0).reshape(16, 2)
    staging = HostBuffer(CPU, cache, torch.zeros(16, 2))
    conn, engine, _ = make(staging=staging)
    req = finished_prefill(engine, prompt_len=10)
    assert conn.on_finish(req, was_loading=False)
    assert torch.equal(staging.host[req.block_ids], cache[req.block_ids])


def test_without_first_token_the_last_prompt_token_is_recomputed():
    conn, engine, transport = make()
    req = decode_request(first_token_id=None)
    assert conn.on_add(req) is None
    engine.scheduler.add(req)
    conn.start_load(engine.scheduler.schedule().to_load)
    settle(conn)
    transport.reads[0].state = "DONE"
    conn.poll()
    assert req.num_computed_tokens == 9


def test_abort_during_read_keeps_blocks_until_the_read_ends():
    conn, engine, transport = make()
    req = decode_request()
    admit(conn, engine, req)
    settle(conn)
    free_before = engine.allocator.num_free
    req.status = Status.FINISHED
    assert conn.on_finish(req, was_loading=True)  # blocks are still being written
    assert engine.allocator.num_free == free_before
    transport.reads[0].state = "DONE"
    conn.poll()
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_abort_before_handshake_still_tells_the_prefill():
    conn, engine, transport = make()
    req = decode_request()
    conn.on_add(req)
    req.status = Status.FINISHED
    assert not conn.on_finish(req, was_loading=False)
    settle(conn)
    assert b"done:p1" in transport.sent and not conn.pulls


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_read_applies_policy(policy):
    conn, engine, transport = make(policy)
    req = decode_request()
    admit(conn, engine, req)
    settle(conn)
    transport.reads[0].state = "ERR"
    out = conn.poll()
    assert conn.metrics.failures._value.get() == 1
    if policy == "recompute":
        assert req.status is Status.WAITING and not req.load_remote and out == []
        assert engine.scheduler.waiting[0] is req
    else:
        assert out[0].error and "failed" in out[0].error
        assert engine.allocator.num_free == engine.allocator.num_blocks


def test_read_timeout_fails_the_pull():
    conn, engine, transport = make("fail", transfer_timeout=0.05)
    req = decode_request()
    admit(conn, engine, req)
    settle(conn)
    time.sleep(0.1)
    (out,) = conn.poll()
    assert "timed out" in out.error


def test_handshake_failure_and_engine_id_mismatch_fail_clearly():
    conn, engine, transport = make("fail")
    transport.refuse = RuntimeError("connection refused")
    req = decode_request()
    admit(conn, engine, req)
    (out,) = settle(conn)
    assert "handshake" in out.error and "connection refused" in out.error
    conn._pool.shutdown(wait=True)
    assert transport.released == ["p1"]  # the prefill still gets its blocks back
    conn2, engine2, transport2 = make("fail")
    transport2.engine_id = "someone-else"
    req2 = decode_request()
    admit(conn2, engine2, req2)
    (out2,) = settle(conn2)
    assert "unknown remote_engine_id" in out2.error


def test_prefill_holds_blocks_under_a_lease_until_the_reader_is_done():
    conn, engine, transport = make(kv_lease_duration=0.2)
    req = finished_prefill(engine, prompt_len=10)
    assert conn.on_finish(req, was_loading=False)
    p = req.response_kv_params
    assert p["do_remote_prefill"] and p["remote_block_ids"] == req.block_ids
    assert p["first_token_id"] == 5 and p["remote_request_id"] == "p1"
    assert p["remote_port"] == 5600 and p["tp_size"] == 1
    transport.inbox.append(b"renew:p1")
    conn.poll()
    assert engine.allocator.num_free == 13
    transport.inbox.append(b"done:p1")
    conn.poll()
    assert engine.allocator.num_free == 16 and conn.metrics.lease_expired._value.get() == 0


def test_unrenewed_lease_expires_and_is_counted():
    conn, engine, transport = make(kv_lease_duration=0.05)
    req = finished_prefill(engine, prompt_len=4)
    conn.on_finish(req, was_loading=False)
    time.sleep(0.1)
    conn.poll()
    assert engine.allocator.num_free == 16 and conn.metrics.lease_expired._value.get() == 1


def test_validate_params():
    conn, _, _ = make()
    good = decode_request().kv_transfer_params
    conn.validate_params(good, 10)
    conn.validate_params({"do_remote_prefill": True}, 10)  # unusable: recomputed, not refused
    for bad, word in [({"remote_host": "192.168.0.1"}, "not allowed"),
                      ({"remote_block_ids": [1]}, "fills 3"),
                      ({"remote_block_ids": [1, -2, 3]}, "non-negative"),
                      ({"remote_port": 70000}, "remote_port"),
                      ({"first_token_id": 10**6}, "first_token_id"),
                      ({"do_remote_decode": "yes"}, "boolean")]:
        with pytest.raises(ValueError, match=word):
            conn.validate_params({**good, **bad}, 10)


def test_short_prompts_are_recomputed_and_the_prefill_released():
    conn, engine, transport = make(min_transfer_tokens=64)
    req = decode_request()
    conn.on_add(req)
    assert not req.load_remote
    settle(conn)
    assert b"done:p1" in transport.sent
