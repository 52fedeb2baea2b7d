"""Read planning between tensor-parallel prefill and decode ranks.

KV head h of a model with H KV heads lives on rank h // (H / T) of a TP=T instance. A
decode rank reads, from each prefill rank whose heads overlap its own, that overlap: whole
blocks when both sides split alike (P == D), else per layer and K/V the head slice, which
is one contiguous run of bytes only in the HND block layout (heads, tokens, dim).

Every reader tells the prefill rank it read from when its READ has landed; the prefill may
free a request's blocks once all readers have. A reader's message carries how many there
are in all (b"tp:<n>:" + the plain message), so a prefill counts without knowing the
decode's TP size in advance."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

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


def check_split(num_kv_heads: int, remote_tp: int, local_tp: int, layout: str) -> None:
    """Refuse a prefill/decode TP pair this planner cannot serve, saying why."""
    for side, tp in (("prefill", remote_tp), ("decode", local_tp)):
        if tp < 1 or num_kv_heads % tp:
            raise IncompatibleKV(f"{side} TP size {tp} does not divide the model's "
                                 f"{num_kv_heads} KV heads")
    if remote_tp != local_tp and layout != "HND":
        raise IncompatibleKV(f"prefill TP={remote_tp} and decode TP={local_tp} differ: a "
                             "decode rank then reads head slices of blocks, which are "
                             "contiguous only with --kv-layout HND; start both sides with "
                             "--kv-layout HND (or equal TP sizes)")


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
class BlockGeometry:
    """An HND block: [num_layers, 2 (K, V), heads, block_size, head_dim] of `itemsize`."""
    num_layers: int
    block_size: int
    head_dim: int
    itemsize: int

    def head_bytes(self) -> int:
        return self.block_size * self.head_dim * self.itemsize


def slice_descs(local: Region, remote: Region, local_ids: list[int], remote_ids: list[int],
                s: Slice, g: BlockGeometry, local_heads: int, remote_heads: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """NIXL (N, 3) [addr, len, devid] arrays for one slice: one descriptor per block,
    layer and K/V (a slice is not contiguous across them)."""
    hb = g.head_bytes()
    planes = np.arange(g.num_layers * 2, dtype=np.uint64)  # (layer, K/V) pairs in order

    def descs(region: Region, ids: list[int], heads: int, first: int) -> np.ndarray:
        starts = region.base + np.asarray(ids, dtype=np.uint64) * region.block_bytes
        offs = (planes * heads + first) * hb
        out = np.empty((len(ids) * planes.size, 3), dtype=np.uint64)
        out[:, 0] = (starts[:, None] + offs[None, :]).ravel()
        out[:, 1] = s.num_heads * hb
        out[:, 2] = region.device
        return out

    return (descs(local, local_ids, local_heads, s.local_head),
            descs(remote, remote_ids, remote_heads, s.remote_head))


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
