"""Heterogeneous-TP read planning: which prefill ranks and head slices each decode rank
reads, the byte ranges they map to, refusals, and reader counting."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer.nixl_agent import Region
from pdserve.kv_transfer.tp_plan import (
    BlockGeometry,
    ReaderCount,
    Slice,
    check_split,
    num_readers,
    plan,
    slice_descs,
    tag,
)
from pdserve.kv_transfer.transport import IncompatibleKV
from pdserve.model.llama import ModelConfig


@pytest.mark.parametrize(("p", "d", "want"), [
    (1, 1, [[Slice(0, 0, 0, 4)]]),
    (2, 1, [[Slice(0, 0, 0, 2), Slice(1, 2, 0, 2)]]),
    (1, 2, [[Slice(0, 0, 0, 2)], [Slice(0, 0, 2, 2)]]),
    (2, 2, [[Slice(0, 0, 0, 2)], [Slice(1, 0, 0, 2)]]),
    (4, 2, [[Slice(0, 0, 0, 1), Slice(1, 1, 0, 1)], [Slice(2, 0, 0, 1), Slice(3, 1, 0, 1)]]),
])
def test_plan_covers_each_decode_ranks_heads_once(p, d, want):
    assert [plan(4, p, d, r) for r in range(d)] == want
    assert num_readers(4, p, d) == sum(map(len, want))


def test_uneven_overlap_reads_from_two_ranks():
    # 6 heads, prefill TP 2 (3 each), decode TP 3 (2 each): the middle rank straddles both
    assert plan(6, 2, 3, 1) == [Slice(0, 0, 2, 1), Slice(1, 1, 0, 1)]
    assert num_readers(6, 2, 3) == 4


def test_refusals_say_why():
    with pytest.raises(IncompatibleKV, match="decode TP size 2 does not divide the model's 3"):
        check_split(3, 1, 2, "HND")
    with pytest.raises(IncompatibleKV, match="--kv-layout HND"):
        check_split(4, 2, 1, "NHD")
    check_split(4, 2, 2, "NHD")  # equal splits read whole blocks: any layout


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2)])
def test_slice_descriptors_move_exactly_the_heads(p, d):
    """Copy bytes as the descriptors say between HND caches of each side's shards; the
    decode shards must then equal the head slices of the whole cache."""
    layers, heads, bs, dim, blocks = 2, 4, 4, 3, 5
    whole = torch.randn(blocks, layers, 2, heads, bs, dim)
    src = [whole[:, :, :, j * heads // p:(j + 1) * heads // p].contiguous() for j in range(p)]
    geo = BlockGeometry(layers, bs, dim, whole.element_size())
    remote_ids, local_ids = [3, 1, 4], [0, 2, 1]
    for r in range(d):
        dst = torch.zeros(blocks, layers, 2, heads // d, bs, dim)
        for s in plan(heads, p, d, r):
            loc, rem = (Region.from_tensor(t, blocks) for t in (dst, src[s.src]))
            ld, rd = slice_descs(loc, rem, local_ids, remote_ids, s, geo, heads // d, heads // p)
            assert len(ld) == len(local_ids) * layers * 2 and (ld[:, 1] == rd[:, 1]).all()
            for (la, n, _), (ra, _, _) in zip(ld.tolist(), rd.tolist(), strict=True):
                _copy(dst, la - loc.base, src[s.src], ra - rem.base, n)
        want = whole[remote_ids][:, :, :, r * heads // d:(r + 1) * heads // d]
        assert torch.equal(dst[local_ids], want)


def _copy(dst: torch.Tensor, doff: int, src: torch.Tensor, soff: int, n: int) -> None:
    d = dst.view(-1).view(torch.uint8).numpy()
    s = src.view(-1).view(torch.uint8).numpy()
    d[doff:doff + n] = s[soff:soff + n]


def test_reader_count_releases_once_all_readers_notified():
    rc = ReaderCount()
    msg = tag(b"done:r1", 3)
    assert rc.feed([msg, msg]) == []
    assert rc.feed([b"renew:r2", msg]) == [b"renew:r2", b"done:r1"]
    assert rc.received == 3 and not rc.seen
    assert tag(b"done:x", 1) == b"done:x"  # one reader: the plain protocol
    assert rc.feed([b"tp:zz:done:a", b"done:a"]) == [b"tp:zz:done:a", b"done:a"]  # junk: plain
    assert rc.feed([tag(b"done:b", 2), b"done:b"]) == [b"done:b"] and not rc.seen


def test_model_shard_sizes_and_refusal():
    c = ModelConfig(1000, 64, 128, 2, 8, 4, 8, 1e-5, 1e4, None, False, False, 128, (2,))
    s = c.shard(2)
    assert (s.num_heads, s.num_kv_heads, s.intermediate_size, s.head_dim) == (4, 2, 64, 8)
    smol = ModelConfig(1000, 576, 1536, 2, 9, 3, 64, 1e-5, 1e4, None, True, False, 128, (2,))
    with pytest.raises(ValueError, match=r"9 attention heads and 3 KV heads do not divide by "
                                         r"2 \(sizes that work: 1, 3\)"):
        smol.shard(2)
