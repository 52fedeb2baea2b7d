"""Read planning between unlike prefill and decode ranks: TP sizes, KV layouts and block
sizes may differ.

KV head h of a model with H KV heads lives on rank h // (H / T) of a TP=T instance. A
decode rank reads, from each prefill rank whose heads overlap its own, that overlap. A
decode block holds k prefill blocks (its block size is k times theirs, k >= 1). Bytes land
where they can without reordering: whole runs of blocks when both sides are alike, else one
descriptor per (block, layer, K/V[, head]); a decode whose layout differs from the prefill's
receives the prefill's order and permutes the received blocks in place (`permute_received`).

Every reader tells the prefill rank it read from when its READ has landed; the prefill may
free a request's blocks once all readers have. A reader's message carries how many there
are in all (b"tp:<n>:" + the plain message), so a prefill counts without knowing the
decode's TP size in advance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.kv_transfer.nixl_agent import Region
from pdserve.kv_transfer.transport import DONE, IncompatibleKV

TAG = b"tp:"


@dataclass(slots=True, frozen=True)
class Slice:
    """KV heads [remote_head, +num_heads) of prefill rank `src` land at local head
    `local_head` of this decode rank."""
    src: int
    local_head: int
    remote_head: int
    num_heads: int


def check_split(num_kv_heads: int, remote_tp: int, local_tp: int) -> None:
    """Refuse TP sizes that do not split the model's KV heads evenly."""
    for side, tp in (("prefill", remote_tp), ("decode", local_tp)):
        if tp < 1 or num_kv_heads % tp:
            raise IncompatibleKV(f"{side} TP size {tp} does not divide the model's "
                                 f"{num_kv_heads} KV heads")


def check_layouts(remote_tp: int, local_tp: int, remote_layout: str, local_layout: str
                  ) -> None:
    """Refuse what cannot be read: head slices of NHD blocks, or an unknown layout."""
    if {remote_layout, local_layout} - {"NHD", "HND"}:
        raise IncompatibleKV(f"unknown KV layout (prefill {remote_layout!r}, decode "
                             f"{local_layout!r})")
    if remote_tp != local_tp and remote_layout != "HND":
        raise IncompatibleKV(f"prefill TP={remote_tp} and decode TP={local_tp} differ: a "
                             "decode rank then reads head slices of the prefill's blocks, "
                             "which are contiguous only with --kv-layout HND; start the "
                             "prefill with --kv-layout HND (the decode may keep its own)")


def check_block_sizes(remote: int, local: int) -> None:
    if local % remote:
        raise IncompatibleKV(f"decode --block-size {local} is not a multiple of the "
                             f"prefill's {remote}: a decode block must hold whole prefill "
                             "blocks")


def plan(num_kv_heads: int, remote_tp: int, local_tp: int, local_rank: int) -> list[Slice]:
    """What decode rank `local_rank` of `local_tp` reads from a TP=`remote_tp` prefill."""
    lh, rh = num_kv_heads // local_tp, num_kv_heads // remote_tp
    lo, hi = local_rank * lh, (local_rank + 1) * lh
    out = []
    for src in range(lo // rh, (hi - 1) // rh + 1):
        a, b = max(lo, src * rh), min(hi, (src + 1) * rh)
        out.append(Slice(src, a - lo, a - src * rh, b - a))
    return out


def num_readers(num_kv_heads: int, remote_tp: int, local_tp: int) -> int:
    """READs (and so notifications) a prefill gets per request from a whole decode."""
    return sum(len(plan(num_kv_heads, remote_tp, local_tp, r)) for r in range(local_tp))


@dataclass(slots=True, frozen=True)
class Blocks:
    """One side's blocks: [num_layers, 2 (K, V), inner], inner (block_size, heads, head_dim)
    under NHD, (heads, block_size, head_dim) under HND."""
    layout: str
    heads: int  # KV heads on this rank
    block_size: int


@dataclass(slots=True, frozen=True)
class Geometry:
    """What both sides' blocks share."""
    num_layers: int
    head_dim: int
    itemsize: int


def read_descs(local: Region, remote: Region, local_ids: list[int], remote_ids: list[int],
               s: Slice, g: Geometry, lb: Blocks, rb: Blocks,
               needed_from: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """NIXL (N, 3) [addr, len, devid] arrays moving slice `s` of remote blocks `remote_ids`
    into local blocks `local_ids` (k remote blocks to a local one, the last maybe fewer).
    `needed_from`: per layer, the first token (counted from the first remote block's) any
    later query of the layer sees; a layer's K/V of blocks wholly before it stay unread
    (sliding-window layers; 0 for the others).

    A remote HND block moves per (layer, K/V, head): b tokens of a head are contiguous on
    both sides. A local NHD block receives them as [k][heads][b][dim] per layer and K/V, for
    `permute_received` to reorder. A remote NHD block moves per (layer, K/V) (the slice is
    all its heads): [b][heads][dim], which is the local order under NHD and is permuted
    under HND. Adjacent descriptors are merged."""
    k, b = lb.block_size // rb.block_size, rb.block_size
    row = g.head_dim * g.itemsize  # one head's one token
    planes = np.arange(g.num_layers * 2, dtype=np.int64)[:, None]  # (layer, K/V) pairs
    n = len(remote_ids)
    sub = np.arange(n, dtype=np.int64) % k  # where a remote block lands in its local one
    lblock = np.asarray(local_ids, dtype=np.int64)[np.arange(n) // k]
    if rb.layout == "HND":
        heads = np.arange(s.num_heads, dtype=np.int64)[None, :]
        r_off = (planes * rb.heads + s.remote_head + heads) * b * row
        if lb.layout == "HND":
            l_off = (planes * lb.heads + s.local_head + heads) * lb.block_size * row
            l_sub = sub * b * row
        else:
            l_off = (planes * lb.block_size * lb.heads + (s.local_head + heads) * b) * row
            l_sub = sub * lb.heads * b * row
        length = b * row
    else:
        r_off = planes * b * rb.heads * row
        l_off, l_sub = planes * lb.block_size * lb.heads * row, sub * b * lb.heads * row
        length = b * rb.heads * row
    raddr = remote.base + np.asarray(remote_ids, dtype=np.int64) * remote.block_bytes
    laddr = local.base + lblock * local.block_bytes + l_sub
    laddr, raddr = laddr[:, None, None] + l_off[None], raddr[:, None, None] + r_off[None]
    if needed_from is not None:  # [block, (layer, K/V)]: the block ends at or past it
        keep = (np.arange(1, n + 1) * b)[:, None] > np.repeat(needed_from, 2)[None, :]
        laddr, raddr = laddr[keep], raddr[keep]
    return _merged(laddr, raddr, length, local.device, remote.device)


def needed_from(windows: Sequence[int | None], num_tokens: int, first_token: int
                ) -> list[int] | None:
    """read_descs' `needed_from` for a prompt of num_tokens whose tokens from first_token
    are read: what the last prompt token's query (the first the decode may run) sees in
    each layer. None where every block is needed (no window, or a prompt within it)."""
    firsts = [max(0, num_tokens - w - first_token) if w else 0 for w in windows]
    return firsts if any(firsts) else None


def _merged(laddr: np.ndarray, raddr: np.ndarray, length: int, ldev: int, rdev: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """Descriptor arrays of equal-length chunks, each run that continues on both sides
    merged into one."""
    laddr, raddr = laddr.ravel(), raddr.ravel()
    cont = np.zeros(laddr.size, dtype=bool)
    cont[1:] = (laddr[1:] == laddr[:-1] + length) & (raddr[1:] == raddr[:-1] + length)
    starts = np.flatnonzero(~cont)
    lens = np.diff(np.append(starts, laddr.size)) * length

    def descs(addr: np.ndarray, dev: int) -> np.ndarray:
        out = np.empty((starts.size, 3), dtype=np.uint64)
        out[:, 0], out[:, 1], out[:, 2] = addr[starts], lens, dev
        return out

    return descs(laddr, ldev), descs(raddr, rdev)


def permute_received(buffer: torch.Tensor, local_ids: list[int], lb: Blocks, rb: Blocks) -> None:
    """Reorder blocks that received another layout's bytes (read_descs) into this side's."""
    k, b, kb = lb.block_size // rb.block_size, rb.block_size, lb.block_size
    row = buffer.shape[-1] * buffer.element_size()
    # Move whole words: a head's row as int64s is 4x fewer elements than as bfloat16.
    words = buffer.view(torch.int64 if row % 8 == 0 else torch.int32 if row % 4 == 0
                        else torch.uint8)
    ids = torch.tensor(local_ids, device=buffer.device)
    got = words.index_select(0, ids)
    n, layers, two, *_, dim = got.shape
    if lb.layout == "HND":  # received [kb][heads][dim] per layer and K/V
        fixed = got.view(n, layers, two, kb, lb.heads, dim).transpose(3, 4)
    else:  # received [k][heads][b][dim]
        fixed = got.view(n, layers, two, k, lb.heads, b, dim).transpose(4, 5)
    words.index_copy_(0, ids, fixed.reshape(got.shape))


def tag(notif: bytes, readers: int) -> bytes:
    return notif if readers == 1 else TAG + str(readers).encode() + b":" + notif


@dataclass(slots=True)
class ReaderCount:
    """Turns readers' tagged messages into one plain message once the last has arrived."""
    seen: dict[bytes, int] = field(default_factory=dict)
    received: int = 0  # reader notifications so far (for the metric)

    def feed(self, msgs: list[bytes]) -> list[bytes]:
        out = []
        for msg in msgs:
            n, inner = _untag(msg)
            if n is None:
                self.seen.pop(msg, None)  # a plain message (e.g. "abandoned") settles it
                self.received += msg.startswith(DONE)
                out.append(msg)
                continue
            self.received += 1
            got = self.seen.pop(inner, 0) + 1
            if got >= n:
                out.append(inner)
            else:
                self.seen[inner] = got
        return out


def _untag(msg: bytes) -> tuple[int | None, bytes]:
    if not msg.startswith(TAG):
        return None, msg
    n, _, inner = msg[len(TAG):].partition(b":")
    return (int(n), inner) if n.isdigit() and inner else (None, msg)
