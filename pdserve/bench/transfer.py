"""KV transfer micro-benchmark: a "decode" process pulls a prompt's blocks from a "prefill" one.

Both hold a block-major KV pool of the embedded model's shape, [num_blocks, layers, K/V,
block_size, kv_heads, head_dim], so one block is one contiguous region and a prompt's blocks
become one NIXL descriptor per run of consecutive ids. The pull rate is printed next to an
in-process memcpy of the same bytes, measured in the same run.

    python -m pdserve.bench.transfer --tokens 1024 --iters 20
    python -m pdserve.bench.transfer --sweep
    python -m pdserve.bench.transfer --decode-layout HND --decode-block-size 64   # converted

With --decode-layout or --decode-block-size unlike the prefill's (NHD, --block-size), the
decode pulls as pdserve does between unlike instances (read_plan: descriptors into its own
blocks, then a permutation when the layouts differ), times each part and checks every byte
against the conversion done by torch.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

import numpy as np
import torch

from pdserve.kv_transfer.nixl_agent import NixlAgent, Region, Xfer
from pdserve.kv_transfer.read_plan import Blocks, Geometry, Slice, permute_received, read_descs

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
SWEEP_TOKENS = (256, 1024, 4096, 8192)


@dataclass(slots=True)
class Setup:
    num_layers: int = 30  # embedded SmolLM2-135M
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "bfloat16"
    num_blocks: int = 64
    progress: str = "thread"
    prefill_progress: str = ""  # "" = same as progress
    progress_delay_us: int = 1000
    target_poll_ms: float = 1.0  # how often the prefill loop drains notifications
    step_ms: float = 0.0  # CPU work between NIXL calls in both loops, like an engine step
    random_fill: bool = False  # the prefill's pool (for conversion checks)

    @property
    def block_bytes(self) -> int:
        return (self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
                * DTYPE_BYTES[self.dtype])


@dataclass(slots=True)
class Result:
    tokens: int
    fragmented: bool
    merge: bool
    descs: int
    mbytes: float
    pull_ms: float  # median wall time from read() to DONE
    pull_gbps: float
    memcpy_gbps: float
    ratio: float
    notif_ms: float  # median time until the prefill side saw the notification
    idle_cpu_decode: float  # CPU seconds per second while idle
    idle_cpu_prefill: float


def _pool(setup: Setup, fill: int) -> np.ndarray:
    # uint8 view of the pool: NIXL moves bytes, the dtype only sets the block size.
    pool = np.empty((setup.num_blocks, setup.block_bytes), dtype=np.uint8)
    pool[:] = (np.arange(setup.num_blocks, dtype=np.uint8)[:, None] + fill)
    return pool


def _random_pool(setup: Setup) -> np.ndarray:
    """The prefill's pool for conversions (a block's bytes all alike would hide a wrong
    permutation); the decode rebuilds it to check what it received."""
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (setup.num_blocks, setup.block_bytes), dtype=np.uint8)


def _region(pool: np.ndarray) -> Region:
    return Region(pool.ctypes.data, pool.shape[0], pool.shape[1])


def _prefill(conn: Connection, setup: Setup) -> None:
    """Child: owns the source pool and answers commands; its loop is the target's progress."""
    pool = _random_pool(setup) if setup.random_fill else _pool(setup, fill=1)
    agent = NixlAgent("prefill", progress=setup.prefill_progress or setup.progress,
                      progress_delay_us=setup.progress_delay_us)
    agent.register(_region(pool))
    conn.send((agent.metadata(), asdict(_region(pool))))
    peer = agent.add_remote(conn.recv())
    seen: list[tuple[float, bytes]] = []
    period = setup.target_poll_ms / 1000
    while True:
        # In "poll" mode this is what keeps READs against us moving; otherwise it only
        # collects messages. Either way it mirrors an engine loop's per-step call.
        seen += [(time.perf_counter(), msg) for _, msg in agent.notifications()]
        _burn(setup.step_ms)
        if not conn.poll(0 if setup.step_ms else period):
            continue
        cmd, arg = conn.recv()
        if cmd == "notifs":
            conn.send(seen)
            seen = []
        elif cmd == "idle":
            conn.send(_idle_cpu(agent, arg, period))
        elif cmd == "stop":
            break
    agent.remove_remote(peer)
    agent.close()
    conn.send("bye")


def _burn(ms: float) -> None:
    """Hold a core for `ms` like a model step would (pure Python: NIXL's thread needs no GIL)."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def _wait(agent: NixlAgent, xfer: Xfer, step_ms: float) -> None:
    if not step_ms:
        return agent.wait(xfer)
    while agent.poll(xfer) == "PROC":  # an engine checks its pulls once per step
        _burn(step_ms)
    if xfer.state == "ERR":
        raise SystemExit("pull failed")


def _idle_cpu(agent: NixlAgent, seconds: float, period: float) -> float:
    """CPU use of this process (all threads, incl. NIXL's) per second while its loop idles."""
    t0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        if agent.progress == "poll":  # its loop's own wake-ups are the cost of this mode
            agent.notifications()
            time.sleep(period)
        else:
            time.sleep(0.05)
    return (time.process_time() - c0) / (time.perf_counter() - t0)


def _memcpy_s(src: np.ndarray, dst: np.ndarray) -> float:
    t0 = time.perf_counter()
    np.copyto(dst, src)  # one thread, like the kernel's single copy for CMA or TCP
    return time.perf_counter() - t0


def _ids(tokens: int, block_size: int, fragmented: bool) -> tuple[np.ndarray, np.ndarray]:
    n = -(-tokens // block_size)
    step = 2 if fragmented else 1  # every other block: no two ids are consecutive
    remote = np.arange(n) * step
    local = np.arange(n)[::-1] * step if fragmented else np.arange(n)
    return local, remote


def _run_case(agent: NixlAgent, conn: Connection, pool: np.ndarray, local: Region,
              remote: Region, peer: str, tokens: int, fragmented: bool, merge: bool,
              setup: Setup, iters: int) -> Result:
    lids, rids = _ids(tokens, setup.block_size, fragmented)
    src = np.ones(lids.size * setup.block_bytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    times, copies, tags = [], [], {}
    for i in range(iters + 2):  # two warm-up pulls (connection set-up, page faults)
        # Interleaved with the pulls so both see the same load from other processes.
        copies.append(_memcpy_s(src, dst))
        pool[lids] = 0
        tag = f"pull-{i}".encode()
        t0 = time.perf_counter()
        xfer = agent.read(local, remote, lids, rids, peer, tag, merge=merge)
        _wait(agent, xfer, setup.step_ms)
        times.append(time.perf_counter() - t0)
        tags[tag] = t0
    if not np.array_equal(pool[lids], (rids[:, None].astype(np.uint8) + 1)
                          * np.ones((1, pool.shape[1]), dtype=np.uint8)):
        raise SystemExit("data check failed: pulled blocks differ from the source")
    time.sleep(0.05)
    conn.send(("notifs", None))
    notif = [t - tags[msg] for t, msg in conn.recv() if msg in tags][2:]
    conn.send(("idle", 2.0))
    idle_decode = _idle_cpu(agent, 2.0, setup.target_poll_ms / 1000)
    idle_prefill = conn.recv()
    pull = statistics.median(times[2:])
    nbytes = xfer.nbytes
    memcpy = nbytes / statistics.median(copies[2:]) / 1e9
    return Result(tokens, fragmented, merge, xfer.descs, nbytes / 1e6, pull * 1e3,
                  nbytes / pull / 1e9, memcpy, nbytes / pull / 1e9 / memcpy,
                  statistics.median(notif) * 1e3 if notif else float("nan"),
                  idle_decode, idle_prefill)


def _as_kv(pool: np.ndarray, setup: Setup, layout: str, block_size: int) -> torch.Tensor:
    """A uint8 pool as [blocks, layers, 2, inner, head_dim * itemsize] bytes."""
    h = setup.num_kv_heads
    inner = (block_size, h) if layout == "NHD" else (h, block_size)
    return torch.from_numpy(pool).view(pool.shape[0], setup.num_layers, 2, *inner, -1)


def _converted(remote: torch.Tensor, rids: np.ndarray, lb: Blocks, tokens: int) -> torch.Tensor:
    """What the decode's blocks must hold: the prompt's tokens, re-blocked in its layout."""
    src = remote[rids]  # NHD prefill blocks: [n, L, 2, b, H, row]
    n, layers, two, b, h, row = src.shape
    seq = src.permute(1, 2, 0, 3, 4, 5).reshape(layers, two, n * b, h, row)[:, :, :tokens]
    m = -(-tokens // lb.block_size)
    pad = torch.zeros(layers, two, m * lb.block_size - tokens, h, row, dtype=src.dtype)
    blocks = torch.cat([seq, pad], 2).view(layers, two, m, lb.block_size, h, row)
    blocks = blocks.permute(2, 0, 1, 3, 4, 5)
    return blocks.transpose(3, 4) if lb.layout == "HND" else blocks


def _run_convert(agent: NixlAgent, peer: str, remote: Region, setup: Setup, tokens: int,
                 lb: Blocks, iters: int) -> dict:
    """Pull a prompt into decode blocks of another layout or size; the median time of
    planning the descriptors, the READ and the permutation, and the bytes checked."""
    rb = Blocks("NHD", setup.num_kv_heads, setup.block_size)
    geo = Geometry(setup.num_layers, setup.head_dim, DTYPE_BYTES[setup.dtype])
    k = lb.block_size // rb.block_size
    rids = np.arange(-(-tokens // rb.block_size))
    lids = list(range(-(-rids.size // k)))
    pool = np.zeros((len(lids), setup.block_bytes * k), dtype=np.uint8)
    local = _region(pool)
    agent.register(local)
    kv = _as_kv(pool, setup, lb.layout, lb.block_size)
    whole = Slice(0, 0, 0, setup.num_kv_heads)
    plans, pulls, perms = [], [], []
    for i in range(iters + 2):
        pool[:] = 0
        t0 = time.perf_counter()
        ld, rd = read_descs(local, remote, lids, rids.tolist(), whole, geo, lb, rb)
        t1 = time.perf_counter()
        agent.wait(agent.read_descs(ld, rd, "DRAM", "DRAM", peer, f"conv-{i}".encode()))
        t2 = time.perf_counter()
        if lb.layout != rb.layout:
            permute_received(kv, lids, lb, rb)
        t3 = time.perf_counter()
        plans.append(t1 - t0), pulls.append(t2 - t1), perms.append(t3 - t2)
    want = _converted(_as_kv(_random_pool(setup), setup, "NHD", rb.block_size), rids, lb,
                      tokens)
    if not torch.equal(kv, want):
        raise SystemExit("data check failed: the converted blocks differ from torch's")
    med = {name: statistics.median(v[2:]) * 1e3 for name, v in
           (("plan_ms", plans), ("pull_ms", pulls), ("permute_ms", perms))}
    return {"tokens": tokens, "decode_layout": lb.layout, "decode_block_size": lb.block_size,
            "descs": len(ld), "mbytes": round(pool.nbytes / 1e6, 1),
            **{k: round(v, 3) for k, v in med.items()}}


def _print(r: Result) -> None:
    print(f"tokens={r.tokens:<6} frag={int(r.fragmented)} merge={int(r.merge)} "
          f"descs={r.descs:<5} {r.mbytes:7.1f} MB  pull {r.pull_ms:7.2f} ms "
          f"{r.pull_gbps:6.2f} GB/s  memcpy {r.memcpy_gbps:6.2f} GB/s  ratio {r.ratio:5.2f}  "
          f"notif {r.notif_ms:6.2f} ms  idle cpu d={r.idle_cpu_decode:.3f} "
          f"p={r.idle_cpu_prefill:.3f}", flush=True)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--fragmented", action="store_true", help="non-consecutive block ids")
    p.add_argument("--no-merge", action="store_true", help="one descriptor per block")
    p.add_argument("--sweep", action="store_true",
                   help=f"tokens {SWEEP_TOKENS} x contiguous/fragmented")
    p.add_argument("--progress", choices=("thread", "poll", "spin"), default="thread")
    p.add_argument("--prefill-progress", choices=("thread", "poll", "spin"), default="",
                   help="progress mode of the prefill (target) side; default: --progress")
    p.add_argument("--progress-delay-us", type=int, default=1000)
    p.add_argument("--target-poll-ms", type=float, default=1.0,
                   help="prefill loop period (its notifications() calls)")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="CPU work per loop turn in both processes (emulates engine steps)")
    p.add_argument("--json", action="store_true", help="also print one JSON line per case")
    p.add_argument("--decode-layout", choices=("NHD", "HND"), default="NHD",
                   help="the decode's KV layout (the prefill's is NHD)")
    p.add_argument("--decode-block-size", type=int, default=None,
                   help="the decode's block size (default: --block-size)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    cases = ([(t, f) for f in (False, True) for t in SWEEP_TOKENS] if args.sweep
             else [(args.tokens, args.fragmented)])
    max_blocks = max(-(-t // args.block_size) * (2 if f else 1) for t, f in cases)
    decode_block_size = args.decode_block_size or args.block_size
    convert = (args.decode_layout, decode_block_size) != ("NHD", args.block_size)
    setup = Setup(block_size=args.block_size, dtype=args.dtype, num_blocks=max_blocks,
                  progress=args.progress, prefill_progress=args.prefill_progress,
                  progress_delay_us=args.progress_delay_us,
                  target_poll_ms=args.target_poll_ms, step_ms=args.step_ms,
                  random_fill=convert)
    decode = Blocks(args.decode_layout, setup.num_kv_heads, decode_block_size)
    print(f"block {setup.block_bytes} B, pool {max_blocks} blocks, progress={setup.progress}, "
          f"step={setup.step_ms} ms, UCX_TLS={os.environ.get('UCX_TLS', '(unset)')}", flush=True)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_prefill, args=(child_conn, setup), daemon=True)
    child.start()
    try:
        pool = _pool(setup, fill=0)
        agent = NixlAgent("decode", progress=setup.progress,
                          progress_delay_us=setup.progress_delay_us)
        local = _region(pool)
        agent.register(local)
        md, remote = conn.recv()
        peer = agent.add_remote(md)
        conn.send(agent.metadata())
        for tokens, frag in cases:
            if convert:
                r = _run_convert(agent, peer, Region(**remote), setup, tokens, decode,
                                 args.iters)
                print(json.dumps(r), flush=True)
                continue
            r = _run_case(agent, conn, pool, local, Region(**remote), peer, tokens, frag,
                          not args.no_merge, setup, args.iters)
            _print(r)
            if args.json:
                print(json.dumps(asdict(r)), flush=True)
        conn.send(("stop", None))
        conn.recv()
        agent.close()
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
