"""Read planning between unlike ranks: which prefill ranks and head slices each decode rank
reads, the byte ranges they map to across TP sizes, layouts and block sizes, refusals, and
reader counting."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer import read_plan
from pdserve.kv_transfer.nixl_agent import Region
from pdserve.kv_transfer.read_plan import (
    Blocks,
    Geometry,
    ReaderCount,
    Slice,
    num_readers,
    permute_received,
    plan,
    read_descs,
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
        read_plan.check_split(3, 1, 2)
    with pytest.raises(IncompatibleKV, match="start the prefill with --kv-layout HND"):
        read_plan.check_layouts(2, 1, "NHD", "HND")
    read_plan.check_layouts(2, 1, "HND", "NHD")  # head slices of HND blocks: any decode layout
    read_plan.check_layouts(2, 2, "NHD", "HND")  # equal splits read whole blocks: any layout
    with pytest.raises(IncompatibleKV, match="unknown KV layout"):
        read_plan.check_layouts(1, 1, "XYZ", "HND")
    with pytest.raises(IncompatibleKV, match="not a multiple of the prefill's 64"):
        read_plan.check_block_sizes(64, 16)
    read_plan.check_block_sizes(16, 64)


def _cache(kv: torch.Tensor, layout: str, block_size: int, heads: slice,
           num_blocks: int, ids: list[int]) -> torch.Tensor:
    """A cache of `num_blocks` holding the tokens of kv [layers, 2, tokens, heads, dim] (its
    `heads` slice) in blocks `ids`, in order."""
    kv = kv[:, :, :, heads]
    layers, two, _, h, dim = kv.shape
    inner = (block_size, h, dim) if layout == "NHD" else (h, block_size, dim)
    cache = torch.zeros(num_blocks, layers, two, *inner)
    for i, block in enumerate(ids):
        part = kv[:, :, i * block_size:(i + 1) * block_size]
        n = part.shape[2]
        if layout == "NHD":
            cache[block, :, :, :n] = part
        else:
            cache[block, :, :, :, :n] = part.transpose(2, 3)
    return cache


# (prefill layout, decode layout, prefill TP, decode TP, k = decode block / prefill block);
# head slices of NHD blocks are refused (check_layouts), so an NHD prefill has equal TP.
UNLIKE = [(rl, ll, p, d, k) for rl in ("HND", "NHD") for ll in ("HND", "NHD")
          for p, d, k in [(1, 1, 1), (1, 1, 4), (2, 1, 1), (1, 2, 2), (2, 2, 4)]
          if p == d or rl == "HND"]


@pytest.mark.parametrize("window", [None, 5], ids=["global", "sliding"])
@pytest.mark.parametrize(("remote_layout", "local_layout", "p", "d", "k"), UNLIKE)
def test_descriptors_and_permutation_rebuild_the_decodes_blocks(remote_layout, local_layout,
                                                                p, d, k, window):
    """Copy bytes as the descriptors say from each prefill rank's cache (its layout, block
    size b) into each decode rank's (its layout, block size k * b), permute what arrived;
    the decode's blocks must then hold every token's KV of its heads, exactly. With a
    sliding window on layer 0, its prefill blocks wholly before the last token's window
    stay unread (zeros)."""
    layers, heads, b, dim, tokens = 2, 4, 2, 3, 19
    kv = torch.randn(layers, 2, tokens, heads, dim)
    needed = read_plan.needed_from([window, None], tokens, 0)
    expected = kv.clone()
    if window:  # the last token (18) sees 14 .. 18: prefill blocks 0 .. 6 are not read
        assert needed == [14, 0]
        expected[0, :, :14] = 0
    geo = Geometry(layers, dim, kv.element_size())
    remote_ids = [5, 3, 7, 0, 8, 2, 9, 1, 4, 6][:-(-tokens // b)]
    local_ids = [3, 0, 5, 1, 2, 4, 11, 7, 9, 6, 10, 8][:-(-tokens // (k * b))]
    rb = Blocks(remote_layout, heads // p, b)
    src = [_cache(kv, remote_layout, b, slice(j * heads // p, (j + 1) * heads // p), 10,
                  remote_ids) for j in range(p)]
    for r in range(d):
        mine = slice(r * heads // d, (r + 1) * heads // d)
        lb = Blocks(local_layout, heads // d, k * b)
        dst = _cache(kv, local_layout, k * b, mine, 12, [])  # all zeros
        for s in plan(heads, p, d, r):
            loc, rem = (Region.from_tensor(t, t.shape[0]) for t in (dst, src[s.src]))
            ld, rd = read_descs(loc, rem, local_ids, remote_ids, s, geo, lb, rb, needed)
            assert (ld[:, 1] == rd[:, 1]).all()
            for (la, n, _), (ra, _, _) in zip(ld.tolist(), rd.tolist(), strict=True):
                _copy(dst, la - loc.base, src[s.src], ra - rem.base, n)
        if remote_layout != local_layout:
            permute_received(dst, local_ids, lb, rb)
        want = _cache(expected, local_layout, k * b, mine, 12, local_ids)
        assert torch.equal(dst[local_ids], want[local_ids])
        others = [i for i in range(12) if i not in local_ids]
        assert not dst[others].any()  # nothing written outside the pulled blocks


def test_alike_blocks_merge_into_one_descriptor_per_run():
    geo, blocks = Geometry(2, 3, 4), Blocks("HND", 4, 2)
    t = torch.zeros(8, 2, 2, 4, 2, 3)
    loc, rem = Region.from_tensor(t, 8), Region.from_tensor(t.clone(), 8)
    ld, _ = read_descs(loc, rem, [1, 2, 3, 6], [4, 5, 6, 0], Slice(0, 0, 0, 4), geo, blocks,
                       blocks)
    # local 1-3 <- remote 4-6 is one run, local 6 <- remote 0 another
    assert ld[:, 1].tolist() == [3 * loc.block_bytes, loc.block_bytes]


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
