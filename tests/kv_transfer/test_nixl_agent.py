"""NixlAgent: descriptor coalescing, and a real READ between two processes."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from pdserve.kv_transfer import nixl_agent
from pdserve.kv_transfer.nixl_agent import (
    NixlAgent,
    Region,
    TransferError,
    apply_ucx_defaults,
    block_descs,
    coalesce,
    load_nixl,
)


def _runs(local, remote):
    return [a.tolist() for a in coalesce(local, remote)]


def test_coalesce_empty():
    assert _runs([], []) == [[], [], []]


def test_coalesce_single():
    assert _runs([5], [9]) == [[5], [9], [1]]


def test_coalesce_all_consecutive():
    assert _runs(range(3, 67), range(10, 74)) == [[3], [10], [64]]


def test_coalesce_gaps_on_both_sides():
    assert _runs([0, 1, 2, 7, 8, 20], [4, 5, 6, 1, 2, 3]) == [[0, 7, 20], [4, 1, 3], [3, 2, 1]]


def test_coalesce_remote_breaks_a_local_run():
    assert _runs([0, 1, 2, 3], [8, 9, 3, 4]) == [[0, 2], [8, 3], [2, 2]]


def test_coalesce_keeps_order_and_rejects_descending():
    # A descending run is not contiguous memory in READ order, so it must not merge.
    assert _runs([3, 2, 1], [3, 2, 1]) == [[3, 2, 1], [3, 2, 1], [1, 1, 1]]


def test_coalesce_length_mismatch():
    with pytest.raises(ValueError, match="2 local ids but 1 remote"):
        coalesce([1, 2], [1])


def test_block_descs():
    region = Region(base=1000, num_blocks=8, block_bytes=10, device=3)
    starts, _, lens = coalesce([2, 3, 6], [0, 1, 5])
    assert block_descs(region, starts, lens).tolist() == [[1020, 20, 3], [1060, 10, 3]]


def test_apply_ucx_defaults_keeps_user_settings():
    env = {"UCX_TLS": "tcp"}
    added = apply_ucx_defaults(env)
    assert env["UCX_TLS"] == "tcp" and "UCX_TLS" not in added
    assert apply_ucx_defaults({}, gpu=True)["UCX_TLS"].endswith("cuda_copy,cuda_ipc")


@pytest.mark.parametrize("present", [False, True])
def test_ucx_defaults_name_cuda_wherever_a_gpu_is_present(monkeypatch, present):
    # NIXL's UCX backend refuses to start on a GPU host without cuda_copy, even for DRAM.
    monkeypatch.setattr(nixl_agent, "nvidia_gpus_present", lambda: present)
    assert apply_ucx_defaults({})["UCX_TLS"].endswith("cuda_copy,cuda_ipc") == present


def _nixl_or_skip() -> None:
    try:
        load_nixl()
    except RuntimeError as e:
        pytest.skip(str(e))


NUM_BLOCKS, BLOCK_ELEMS = 8, 4096  # 16 KiB blocks of float32


def _source_data() -> torch.Tensor:
    # Every block distinct, every element distinct within a block.
    return (torch.arange(NUM_BLOCKS)[:, None] * 10_000 + torch.arange(BLOCK_ELEMS)).float()


def _prefill_peer(conn) -> None:
    """Process A: owns the source blocks and reports the notifications it receives."""
    kv = _source_data()
    with NixlAgent("test-prefill") as agent:
        agent.register(Region.from_tensor(kv, NUM_BLOCKS))
        conn.send((agent.metadata(), Region.from_tensor(kv, NUM_BLOCKS)))
        agent.add_remote(conn.recv())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if notifs := agent.notifications():
                conn.send(notifs)
                break
            time.sleep(0.001)
        conn.recv()  # keep the source alive until the reader has checked it


def test_read_between_processes():
    _nixl_or_skip()
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    peer = ctx.Process(target=_prefill_peer, args=(child_conn,), daemon=True)
    peer.start()
    try:
        kv = torch.full((NUM_BLOCKS, BLOCK_ELEMS), -1.0)
        local = Region.from_tensor(kv, NUM_BLOCKS)
        with NixlAgent("test-decode") as agent:
            agent.register(local)
            assert conn.poll(20), "prefill peer did not start"
            metadata, remote = conn.recv()
            name = agent.add_remote(metadata)
            conn.send(agent.metadata())
            local_ids, remote_ids = [0, 1, 5, 7], [1, 2, 3, 6]
            xfer = agent.read(local, remote, local_ids, remote_ids, name, b"req-1")
            assert xfer.descs == 3 and xfer.nbytes == 4 * local.block_bytes
            agent.wait(xfer, timeout_s=10)
            assert agent.poll(xfer) == "DONE" and xfer.handle is None
            assert conn.poll(10), "prefill peer got no notification"
            assert conn.recv() == [("test-decode", b"req-1")]
            src = _source_data()
            assert torch.equal(kv[local_ids], src[remote_ids])
            untouched = [i for i in range(NUM_BLOCKS) if i not in local_ids]
            assert bool((kv[untouched] == -1).all())
            conn.send("done")
    finally:
        peer.join(10)
        if peer.is_alive():
            peer.kill()
    assert peer.exitcode == 0


def test_errors_are_transfer_errors():
    _nixl_or_skip()
    buf = torch.zeros(4, 256)
    region = Region.from_tensor(buf, 4)
    with NixlAgent("test-errors") as agent:
        agent.register(region)
        with pytest.raises(TransferError, match="load remote metadata"):
            agent.add_remote(b"not nixl metadata")
        with pytest.raises(TransferError, match="start READ from nobody"):
            agent.read(region, region, [0], [1], "nobody")
        with pytest.raises(ValueError, match="remote block id out of range"):
            agent.read(region, region, [0], [4], "nobody")
