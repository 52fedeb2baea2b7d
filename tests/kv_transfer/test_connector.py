"""The P/D connector through its contract (kv_transfer/interface.py) over a fake transport:
what it answers and reports for each event. The real NIXL path is covered end to end in
tests/e2e/test_pd.py, the engine's side of the contract in tests/engine/test_engine_kv.py."""

from __future__ import annotations

import time
from concurrent.futures import wait
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.connector import PDConnector
from pdserve.kv_transfer.interface import (
    ConnectorContext,
    KVConnectorOutput,
    Load,
    RemotePrefill,
)
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.kv_transfer.params import FirstToken, KVParams
from pdserve.kv_transfer.transport import IncompatibleKV, Peer, Transport

BLOCK_SIZE, BLOCK_BYTES = 4, 1000
FIRST = FirstToken(42, -0.5, [])


class FakeTransport(Transport):
    def __init__(self) -> None:
        self.reads: list[SimpleNamespace] = []
        self.sent: list[bytes] = []
        self.inbox: list[bytes] = []
        self.engine_id = "prefill-a"
        self.block_size = BLOCK_SIZE
        self.refuse: Exception | None = None
        self.released: list[str] = []
        self.staged: list[list[int]] = []
        self.forgotten: list[Peer] = []
        self.connects = 0

    def connect(self, host, port):
        self.connects += 1
        if self.refuse:
            raise self.refuse
        return Peer(host, port, self.engine_id, "agent", 100, self.block_size, {})

    def forget(self, peer):
        self.forgotten.append(peer)

    def read(self, peer, local_ids, remote_ids, notif, needed_from=None):
        h = SimpleNamespace(local=local_ids, remote=remote_ids, notif=notif, state="PROC")
        self.reads.append(h)
        return h

    def poll(self, handle):
        return handle.state

    def handle_stats(self, handle):
        return len(handle.local) * BLOCK_BYTES, 1

    def notify(self, peer, msg):
        self.sent.append(msg)

    def notifications(self):
        out, self.inbox = self.inbox, []
        return out

    def release(self, host, port, request_id):
        self.released.append(request_id)

    def stage_out(self, block_ids):
        self.staged.append(list(block_ids))

    def info(self):
        return {"engine_id": "me", "side_channel_host": "127.0.0.1", "side_channel_port": 5600}

    def close(self):
        pass


def make(policy: str = "recompute", role: str = "kv_both", **extra
         ) -> tuple[PDConnector, FakeTransport]:
    cfg = KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": role,
                                      "kv_load_failure_policy": policy,
                                      "kv_connector_extra_config": extra})
    ctx = ConnectorContext("me", 0, 1, BLOCK_SIZE, BLOCK_BYTES, 1000)
    transport = FakeTransport()
    metrics = TransferMetrics(CollectorRegistry(), "me")
    return PDConnector(cfg, ctx, transport, metrics), transport


def decode_params(**overrides) -> KVParams:
    return KVParams.from_dict({
        "do_remote_prefill": True, "remote_engine_id": "prefill-a",
        "remote_block_ids": [7, 8, 9], "remote_request_id": "p1", "remote_host": "127.0.0.1",
        "remote_port": 5600, "first_token_id": 42, "first_token_logprob": -0.5, **overrides})


def admit(conn: PDConnector, blocks: list[int], cached_tokens: int = 0, prompt_len: int = 10,
          **overrides) -> KVConnectorOutput:
    """A decode request arrives and gets its blocks."""
    remote = conn.on_new_request("d1", decode_params(**overrides), prompt_len)
    assert remote == RemotePrefill(True, FIRST if "first_token_id" not in overrides else None)
    return conn.start_loads([Load("d1", blocks, cached_tokens)])


def wait_for(cond, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def settle(conn: PDConnector) -> KVConnectorOutput:
    """Let the handshake thread finish, then poll."""
    wait(list(conn.consumer.connecting.values()), timeout=5)
    return conn.poll()


def test_pull_lands_and_is_reported_loaded():
    conn, transport = make()
    assert admit(conn, [0, 1, 2]) == KVConnectorOutput()  # the handshake is still running
    assert settle(conn) == KVConnectorOutput()  # the read is posted, not landed
    (read,) = transport.reads
    assert (read.local, read.remote, read.notif) == ([0, 1, 2], [7, 8, 9], b"done:p1")
    read.state = "DONE"
    assert conn.poll() == KVConnectorOutput(loaded=["d1"])
    assert conn.metrics.num_pulls == 1 and conn.metrics.num_bytes == 3000
    assert not conn.busy()


def test_a_read_that_lands_at_once_is_reported_by_start_loads():
    conn, transport = make()
    conn.on_new_request("warm", decode_params(), 10)
    settle(conn)  # a peer now known: the next pull posts its read in start_loads
    transport.sent.clear()
    conn.on_new_request("d1", decode_params(), 10)
    transport.read = lambda *a: SimpleNamespace(local=a[1], state="DONE")
    assert conn.start_loads([Load("d1", [0, 1, 2], 0)]) == KVConnectorOutput(loaded=["d1"])


def test_blocks_in_the_local_prefix_cache_are_not_pulled_again():
    conn, transport = make()
    admit(conn, [3, 4, 5], cached_tokens=8)  # blocks 7, 8 (full) are cached here
    settle(conn)
    (read,) = transport.reads
    assert read.remote == [9] and read.local == [5]
    assert conn.metrics.bytes_saved._value.get() == 2 * BLOCK_BYTES
    read.state = "DONE"
    assert conn.poll().loaded == ["d1"]


def test_a_full_local_hit_pulls_nothing_and_tells_the_prefill():
    conn, transport = make()
    admit(conn, [3, 4], cached_tokens=8, prompt_len=8, remote_block_ids=[7, 8])
    assert settle(conn) == KVConnectorOutput(loaded=["d1"])
    assert not transport.reads and transport.sent == [b"done:p1"] and not conn.busy()


def test_prefill_stages_out_before_announcing():
    conn, transport = make()
    kept, _ = conn.request_finished("p1", KVParams(do_remote_decode=True), [1, 2, 3],
                                    FirstToken(5, -1.0))
    assert kept and transport.staged == [[1, 2, 3]]


def test_without_a_first_token_none_is_handed_on():
    conn, transport = make()
    admit(conn, [0, 1, 2], first_token_id=None)
    settle(conn)
    transport.reads[0].state = "DONE"
    assert conn.poll().loaded == ["d1"]


def test_abort_during_read_keeps_blocks_until_the_read_ends():
    conn, transport = make()
    admit(conn, [0, 1, 2, 3])
    settle(conn)
    assert conn.request_finished("d1", decode_params(), [0, 1, 2, 3], None) == (True, None)
    assert conn.poll() == KVConnectorOutput()  # still being written
    transport.reads[0].state = "DONE"
    assert conn.poll() == KVConnectorOutput(free_blocks=[0, 1, 2, 3])  # not loaded


def test_abort_before_handshake_still_tells_the_prefill():
    conn, transport = make()
    conn.on_new_request("d1", decode_params(), 10)
    assert conn.request_finished("d1", decode_params(), [0, 1, 2], None) == (False, None)
    assert settle(conn) == KVConnectorOutput()
    assert b"done:p1" in transport.sent and not transport.reads and not conn.busy()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_read_applies_policy(policy):
    conn, transport = make(policy)
    admit(conn, [0, 1, 2])
    settle(conn)
    transport.reads[0].state = "ERR"
    out = conn.poll()
    # The peer may be gone or started again (a new agent): released over the side channel.
    wait_for(lambda: transport.released == ["p1"])
    assert conn.metrics.num_failures == 1 and b"done:p1" not in transport.sent
    if policy == "recompute":
        assert out == KVConnectorOutput(recompute=["d1"])
    else:
        assert list(out.failed) == ["d1"] and "failed" in out.failed["d1"]
        assert not out.recompute and not out.free_blocks  # the engine frees its blocks


def test_a_peer_whose_read_failed_is_forgotten_and_handshaken_afresh():
    """A prefill restarted at the same address (same engine id, a new NIXL agent): the
    stale agent is dropped after the failed READ; the next request handshakes again."""
    conn, transport = make()
    admit(conn, [0, 1, 2])
    settle(conn)
    peer = conn.consumer.peers[("127.0.0.1", 5600)]
    transport.reads[0].state = "ERR"
    assert conn.poll().recompute == ["d1"]
    assert transport.forgotten == [peer] and not conn.consumer.peers
    conn.on_new_request("d2", decode_params(remote_request_id="p2"), 10)
    conn.start_loads([Load("d2", [3, 4, 5], 0)])
    settle(conn)
    assert transport.connects == 2 and len(transport.reads) == 2
    transport.reads[1].state = "DONE"
    assert conn.poll().loaded == ["d2"]


def test_failed_read_of_an_ended_request_gives_its_blocks_back():
    conn, transport = make()
    admit(conn, [0, 1, 2])
    settle(conn)
    conn.request_finished("d1", decode_params(), [0, 1, 2], None)
    transport.reads[0].state = "ERR"
    assert conn.poll() == KVConnectorOutput(free_blocks=[0, 1, 2])


def test_read_timeout_fails_the_pull():
    conn, _ = make("fail", transfer_timeout=0.05)
    admit(conn, [0, 1, 2])
    settle(conn)
    time.sleep(0.1)
    assert "timed out" in conn.poll().failed["d1"]


def test_handshake_failure_and_engine_id_mismatch_fail_clearly():
    conn, transport = make("fail")
    transport.refuse = RuntimeError("connection refused")
    admit(conn, [0, 1, 2])
    why = settle(conn).failed["d1"]
    assert "handshake" in why and "connection refused" in why
    conn.consumer._pool.shutdown(wait=True)
    assert transport.released == ["p1"]  # the prefill still gets its blocks back
    conn2, transport2 = make("fail")
    transport2.engine_id = "someone-else"
    admit(conn2, [0, 1, 2])
    assert "unknown remote_engine_id" in settle(conn2).failed["d1"]


def test_a_misconfigured_pair_fails_even_under_the_recompute_policy():
    conn, transport = make("recompute")
    transport.refuse = IncompatibleKV("block_size: prefill 16, decode 32")
    admit(conn, [0, 1, 2])
    out = settle(conn)
    assert "block_size" in out.failed["d1"] and not out.recompute


def test_a_load_whose_pull_was_given_up_is_recomputed():
    conn, transport = make()
    transport.refuse = RuntimeError("connection refused")
    conn.on_new_request("d1", decode_params(), 10)
    assert settle(conn).recompute == ["d1"]
    assert conn.start_loads([Load("d1", [0, 1, 2], 0)]) == KVConnectorOutput(recompute=["d1"])


def test_prefill_holds_blocks_under_a_lease_until_the_reader_is_done():
    conn, transport = make(kv_lease_duration=0.2)
    kept, p = conn.request_finished("p1", KVParams(do_remote_decode=True), [4, 5, 6],
                                    FirstToken(5, -1.0))
    assert kept and p.do_remote_prefill and p.remote_block_ids == [4, 5, 6]
    assert (p.first_token_id, p.remote_request_id, p.remote_port, p.tp_size) == \
        (5, "p1", 5600, 1)
    assert p.to_dict()["remote_engine_id"] == "me" and "first_token_top_logprobs" not in \
        p.to_dict()
    transport.inbox.append(b"renew:p1")
    assert conn.poll() == KVConnectorOutput() and conn.busy()
    transport.inbox.append(b"done:p1")
    assert conn.poll() == KVConnectorOutput(free_blocks=[4, 5, 6])
    assert conn.metrics.num_expired == 0 and not conn.busy()


def test_unrenewed_lease_expires_and_is_counted():
    conn, _ = make(kv_lease_duration=0.05)
    conn.request_finished("p1", KVParams(do_remote_decode=True), [4], FirstToken(5, -1.0))
    time.sleep(0.1)
    assert conn.poll() == KVConnectorOutput(free_blocks=[4])
    assert conn.metrics.num_expired == 1


def test_end_leases_frees_every_held_block_at_the_next_poll():
    conn, _ = make()
    conn.request_finished("p1", KVParams(do_remote_decode=True), [4], FirstToken(5, -1.0))
    conn.request_finished("p2", KVParams(do_remote_decode=True), [6, 7], FirstToken(5, -1.0))
    conn.end_leases()
    assert sorted(conn.poll().free_blocks) == [4, 6, 7]


def test_only_completed_prefills_for_a_remote_decode_are_held():
    conn, _ = make()
    assert conn.request_finished("p1", KVParams(do_remote_decode=True), [4], None) == \
        (False, None)  # aborted: no first token
    assert conn.request_finished("p2", None, [4], FirstToken(5, -1.0)) == (False, None)


@pytest.mark.parametrize(("role", "pulls", "holds"), [
    ("kv_producer", False, True), ("kv_consumer", True, False), ("kv_both", True, True)])
def test_the_role_decides_what_the_connector_does(role, pulls, holds):
    conn, _ = make(role=role)
    assert (conn.on_new_request("d1", decode_params(), 10) is not None) == pulls
    kept, _ = conn.request_finished("p1", KVParams(do_remote_decode=True), [4],
                                    FirstToken(5, -1.0))
    assert kept == holds


def test_short_prompts_are_recomputed_and_the_prefill_released():
    conn, transport = make(min_transfer_tokens=64)
    assert conn.on_new_request("d1", decode_params(), 10) == RemotePrefill(False, FIRST)
    settle(conn)
    assert b"done:p1" in transport.sent and not transport.reads
