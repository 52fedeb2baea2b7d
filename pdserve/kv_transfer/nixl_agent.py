"""A thin wrapper over NIXL's Python API: block-granular READs between two registered regions.

The KV connector thinks in block ids; NIXL thinks in (address, length, device) descriptors.
This module turns the former into the latter (merging consecutive blocks into one descriptor),
hides NIXL's progress and notification quirks, and turns NIXL failures into TransferError.
"""

from __future__ import annotations

import glob
import importlib
import os
import time
import uuid
from collections.abc import MutableMapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

import numpy as np

from pdserve.kv_transfer.transport import XferState

Progress = Literal["thread", "poll", "spin"]

# Measured on one host with two processes:
# - UCX_TLS: naming cma makes an intra-node READ one zero-copy process_vm_readv by the
#   initiator (~memcpy speed, no target involvement); with UCX_TLS unset UCX 1.21 picked a
#   software-emulated GET over tcp (target answers with AM fragments) at ~1/3 the rate.
#   tcp carries notifications and inter-host pulls, where UCX skips cma by itself, and it
#   supports the peer-failure mode NIXL asks for. UCX_NET_DEVICES stays unset (all
#   interfaces) so the default also works across hosts and network namespaces.
# - UCX_USE_MT_MUTEX: with NIXL's progress thread the worker lock is a spinlock by default;
#   the thread waking up mid-copy spun on it and halved the rate of a 24 MB pull on 2 cores.
UCX_DEFAULTS = {"UCX_TLS": "cma,tcp,self", "UCX_USE_MT_MUTEX": "y"}
# Only on a host with NVIDIA GPUs, where NIXL's UCX backend refuses to start without
# cuda_copy even if it registers host memory alone (nixl-cu12 1.5.1, seen on an H200);
# elsewhere UCX warns that the transports are absent.
UCX_GPU_TLS = ",cuda_copy,cuda_ipc"


class TransferError(RuntimeError):
    """A NIXL operation failed: bad metadata, unreachable or dead peer, or a failed transfer."""


def load_nixl() -> ModuleType:
    """Return NIXL's `_api` module, the wheel built for torch's CUDA major version first: its
    UCX needs that version's libcudart to register VRAM (nixl-cu12 under a CUDA-13 torch
    sees GPU memory as host memory and refuses it)."""
    import torch

    major = torch.version.cuda.split(".")[0] if torch.version.cuda else "12"  # CPU build: 12
    for name in dict.fromkeys([f"nixl_cu{major}", "nixl_cu12", "nixl_cu13", "nixl"]):
        try:
            return importlib.import_module(name + "._api")
        except ImportError:
            continue
    raise RuntimeError(f"NIXL is not installed: pip install --no-deps nixl-cu{major}")


def nvidia_gpus_present() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def apply_ucx_defaults(env: MutableMapping[str, str] = os.environ, *,
                       gpu: bool = False) -> dict[str, str]:
    """Set UCX_DEFAULTS where unset and return what was set. UCX reads them when the first
    agent's backend starts, so call this (or let NixlAgent call it) before that."""
    defaults = dict(UCX_DEFAULTS)
    if gpu or nvidia_gpus_present():
        defaults["UCX_TLS"] += UCX_GPU_TLS
    added = {k: v for k, v in defaults.items() if k not in env}
    env.update(added)
    return added


@dataclass(slots=True)
class Region:
    """A registered buffer of `num_blocks` equal blocks, `block_bytes` apart, from `base`."""

    base: int
    num_blocks: int
    block_bytes: int
    mem_type: str = "DRAM"  # "DRAM" or "VRAM"
    device: int = 0

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @classmethod
    def from_tensor(cls, t: Any, num_blocks: int) -> Region:
        """A contiguous torch tensor whose first dimension (or bytes) splits into blocks."""
        if not t.is_contiguous():
            raise ValueError("KV region tensor must be contiguous")
        nbytes = t.numel() * t.element_size()
        if nbytes % num_blocks:
            raise ValueError(f"{nbytes} bytes do not split into {num_blocks} equal blocks")
        if t.device.type == "cuda":
            return cls(t.data_ptr(), num_blocks, nbytes // num_blocks, "VRAM", t.device.index or 0)
        return cls(t.data_ptr(), num_blocks, nbytes // num_blocks)


def coalesce(local_ids: Sequence[int] | np.ndarray, remote_ids: Sequence[int] | np.ndarray,
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge pairs into runs where both sides step by +1: (local_starts, remote_starts, lengths).

    Pair order is kept, so a run never reorders data; ids are not sorted first.
    """
    loc = np.asarray(local_ids, dtype=np.int64).ravel()
    rem = np.asarray(remote_ids, dtype=np.int64).ravel()
    if loc.shape != rem.shape:
        raise ValueError(f"{loc.size} local ids but {rem.size} remote ids")
    if loc.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty.copy(), empty.copy()
    breaks = (np.diff(loc) != 1) | (np.diff(rem) != 1)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    lengths = np.diff(np.append(starts, loc.size))
    return loc[starts], rem[starts], lengths


def block_descs(region: Region, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """NIXL's (N, 3) [addr, len, devid] descriptor array, one row per run of blocks."""
    out = np.empty((starts.size, 3), dtype=np.uint64)
    out[:, 0] = region.base + starts.astype(np.uint64) * region.block_bytes
    out[:, 1] = lengths.astype(np.uint64) * region.block_bytes
    out[:, 2] = region.device
    return out


@dataclass(slots=True)
class Xfer:
    """An in-flight READ. `descs` and `nbytes` are for metrics; `handle` is None once released."""

    handle: Any
    descs: int
    nbytes: int
    started: float = field(default_factory=time.perf_counter)
    state: XferState = "PROC"


class NixlAgent:
    """One NIXL agent with a UCX backend, pulling blocks from remote agents with READ.

    Progress (who drives UCX; a READ's target must be progressed too, on every transport):
      "thread": NIXL's progress thread, sleeping in poll() on UCX's event fd with a
                `progress_delay_us` timeout (rounded up to whole ms). Event-driven: neither
                side's loop has to call anything for a READ to complete, and a READ runs on
                between engine steps. ~1% of a core idle. The default.
      "poll":   no thread. UCX moves only inside poll()/notifications()/notify(): the target
                must call notifications() every few ms or READs against it stall, and the
                reader's READ advances only when it polls (once per engine step).
      "spin":   NIXL's stock thread (delay 0): a full core per agent, and on 2 cores slower.
    Not for concurrent use by several threads beyond what NIXL's RW sync mode allows.
    """

    def __init__(self, name: str | None = None, *, progress: Progress = "thread",
                 progress_delay_us: int = 1000, ucx_defaults: bool = True, gpu: bool = False,
                 backend_params: dict[str, str] | None = None) -> None:
        if progress not in ("thread", "poll", "spin"):
            raise ValueError(f"progress must be thread, poll or spin, got {progress!r}")
        if ucx_defaults:
            apply_ucx_defaults(gpu=gpu)
        self._api = load_nixl()
        self._errors = _nixl_errors(self._api)
        self.name = name or f"pdserve-{uuid.uuid4().hex[:12]}"
        self.progress = progress
        delay = 0 if progress == "spin" else max(1, progress_delay_us)
        with self._guard("create agent"):
            self._agent = self._make_agent(progress != "poll", delay, backend_params or {})
        self._regs: list[Any] = []
        self._remotes: set[str] = set()

    def _make_agent(self, thread: bool, delay_us: int, params: dict[str, str]) -> Any:
        api = self._api
        # nixl_agent() hard-codes pthrDelay=0 (a busy-spinning progress thread), so build the
        # core agent from the bindings with our delay and hand it to the Python wrapper.
        agent = api.nixl_agent(self.name, api.nixl_agent_config(
            enable_prog_thread=False, backends=[]))
        bind = api.nixlBind
        cfg = bind.nixlAgentConfig()
        cfg.useProgThread = thread
        cfg.useListenThread = False
        cfg.pthrDelay = delay_us
        # The connector may call from a handshake thread and the engine loop at once.
        cfg.syncMode = bind.NIXL_THREAD_SYNC_RW
        agent.agent = bind.nixlAgent(self.name, cfg)
        if "UCX" not in agent.get_plugin_list():
            raise TransferError("NIXL has no UCX plugin")
        agent.create_backend("UCX", params)
        return agent

    def _guard(self, what: str) -> _Guard:
        return _Guard(what, self._errors)

    def register(self, region: Region) -> None:
        """Register a region with UCX once; remote agents learn it through metadata()."""
        descs = np.array([[region.base, region.nbytes, region.device]], dtype=np.uint64)
        with self._guard("register memory"):
            self._regs.append(self._agent.register_memory(descs, region.mem_type))

    def metadata(self) -> bytes:
        """This agent's connection info and registrations, for a peer's add_remote()."""
        with self._guard("get metadata"):
            return self._agent.get_agent_metadata()

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata (call again after it registers more memory); returns its name."""
        with self._guard("load remote metadata"):
            name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        """Forget a peer and disconnect from it; unknown names are ignored."""
        self._remotes.discard(name)
        with suppress(*self._errors):  # already gone or never connected: nothing to drop
            self._agent.remove_remote_agent(name)

    def read(self, local: Region, remote: Region, local_ids: Sequence[int] | np.ndarray,
             remote_ids: Sequence[int] | np.ndarray, remote_agent: str, notif: bytes = b"",
             *, merge: bool = True) -> Xfer:
        """Start pulling remote blocks `remote_ids` into local blocks `local_ids`.

        `notif` reaches the remote's notifications() once the data has landed here. With
        merge=False every block is its own descriptor (for benchmarking the coalescing).
        """
        if local.block_bytes != remote.block_bytes:
            raise ValueError(f"block size mismatch: {local.block_bytes} != {remote.block_bytes}")
        lstart, rstart, lens = _runs(local_ids, remote_ids, merge)
        _check_ids(local, lstart, lens, "local")
        _check_ids(remote, rstart, lens, "remote")
        if lens.size == 0:  # nothing to move, but the target still expects its message
            if notif:
                self.notify(remote_agent, notif)
            return Xfer(None, 0, 0, state="DONE")
        return self.read_descs(block_descs(local, lstart, lens), block_descs(remote, rstart, lens),
                               local.mem_type, remote.mem_type, remote_agent, notif)

    def read_descs(self, local: np.ndarray, remote: np.ndarray, local_mem: str,
                   remote_mem: str, remote_agent: str, notif: bytes = b"") -> Xfer:
        """Start one READ of raw (N, 3) [addr, len, devid] descriptor arrays, pairwise."""
        with self._guard(f"start READ from {remote_agent}"):
            ldl = self._agent.get_xfer_descs(local, local_mem)
            rdl = self._agent.get_xfer_descs(remote, remote_mem)
            handle = self._agent.initialize_xfer("READ", ldl, rdl, remote_agent, notif)
            state = self._agent.transfer(handle)
        xfer = Xfer(handle, len(local), int(local[:, 1].sum()))
        if state == "ERR":
            self._release(xfer)
            raise TransferError(f"NIXL refused to post a READ from {remote_agent}")
        return xfer

    def poll(self, xfer: Xfer) -> XferState:
        """Progress and check a READ; the handle is released once it is DONE or ERR."""
        if xfer.handle is None:
            return xfer.state
        try:
            xfer.state = self._agent.check_xfer_state(xfer.handle)
        except self._errors:  # a peer that died mid-transfer surfaces as an exception here
            xfer.state = "ERR"
        if xfer.state != "PROC":
            self._release(xfer)
        return xfer.state

    def wait(self, xfer: Xfer, timeout_s: float = 30.0, interval_s: float = 0.0) -> None:
        """Block until `xfer` is DONE, polling every `interval_s`; TransferError on failure."""
        deadline = time.monotonic() + timeout_s
        while (state := self.poll(xfer)) == "PROC":
            if time.monotonic() > deadline:
                raise TransferError(f"READ of {xfer.nbytes} bytes timed out after {timeout_s}s")
            time.sleep(interval_s)  # 0 still yields the GIL and the CPU
        if state == "ERR":
            raise TransferError(f"READ of {xfer.nbytes} bytes failed (peer gone?)")

    def notify(self, remote_agent: str, msg: bytes) -> None:
        """Send a standalone message to a peer's notifications()."""
        with self._guard(f"notify {remote_agent}"):
            self._agent.send_notif(remote_agent, msg)

    def notifications(self) -> list[tuple[str, bytes]]:
        """Drain messages that arrived since the last call, as (sender agent, message).

        This also progresses UCX; with progress="poll" the target of READs must call it often.
        """
        with self._guard("get notifications"):
            notifs = self._agent.get_new_notifs()
        return [(agent, msg) for agent, msgs in notifs.items() for msg in msgs]

    def close(self) -> None:
        """Drop peers and registrations. In-flight READs must be done (or abandoned) first."""
        agent, self._agent = getattr(self, "_agent", None), None
        if agent is None:
            return
        for name in list(self._remotes):
            self._remotes.discard(name)
            with suppress(*self._errors):
                agent.remove_remote_agent(name)
        for reg in self._regs:
            with suppress(*self._errors):
                agent.deregister_memory(reg)
        self._regs.clear()

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release(self, xfer: Xfer) -> None:
        handle, xfer.handle = xfer.handle, None
        with suppress(*self._errors):
            handle.release()


def _runs(local_ids: Any, remote_ids: Any, merge: bool) -> tuple[np.ndarray, ...]:
    if merge:
        return coalesce(local_ids, remote_ids)
    loc = np.asarray(local_ids, dtype=np.int64).ravel()
    rem = np.asarray(remote_ids, dtype=np.int64).ravel()
    if loc.shape != rem.shape:
        raise ValueError(f"{loc.size} local ids but {rem.size} remote ids")
    return loc, rem, np.ones_like(loc)


def _check_ids(region: Region, starts: np.ndarray, lens: np.ndarray, side: str) -> None:
    # NIXL would reject out-of-range descriptors too, but with an opaque error.
    if starts.size and (starts.min() < 0 or (starts + lens).max() > region.num_blocks):
        raise ValueError(f"{side} block id out of range 0..{region.num_blocks - 1}")


def _nixl_errors(api: ModuleType) -> tuple[type[BaseException], ...]:
    # The bindings raise one Exception subclass per nixl_status_t (nixlBackendError, ...).
    bind = api.nixlBind
    errs = tuple(v for k, v in vars(bind).items() if k.endswith("Error") and isinstance(v, type))
    return (*errs, RuntimeError, ValueError)


@dataclass(slots=True)
class _Guard:
    """Turns NIXL exceptions into TransferError("<what>: <nixl message>")."""

    what: str
    errors: tuple[type[BaseException], ...]

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> bool:
        if exc is not None and isinstance(exc, self.errors) and not isinstance(exc, TransferError):
            raise TransferError(f"NIXL failed to {self.what}: {type(exc).__name__}: {exc}") from exc
        return False
