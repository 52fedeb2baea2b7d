"""Tensor parallelism: T rank processes, each holding a slice of every layer (heads, MLP
width) and its own KV shard, joined by torch.distributed (gloo on CPU, the device's
collective library elsewhere; see platforms).

Rank 0 is the engine (scheduler, sampler, connector bookkeeping). It broadcasts a command
for every step ("step", batch) and for every KV-transfer action its workers must mirror;
workers run the same forward on their shard (the all-reduces inside it meet rank 0's) and
answer commands that need a reply through a gather. One lock orders all group traffic on
rank 0, so a handshake thread's command never lands between a forward's all-reduces."""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pdserve.config import CHECKPOINT_QUANTIZATIONS, ConfigError, EngineConfig
from pdserve.engine.heap import freeze_heap
from pdserve.model import checkpoint_weights, loader
from pdserve.model.checkpoint_weights import CheckpointWeights
from pdserve.model.gguf_weights import GGUFWeights
from pdserve.model.kv_cache import KVCache, cache_dtype
from pdserve.model.llama import Batch, Chunk, LlamaModel, ModelConfig
from pdserve.model.quant import Table
from pdserve.platforms import get_platform
from pdserve.platforms.base import Platform

log = logging.getLogger("pdserve.tp")

# An idle server sends no collectives; a worker waits for its next command that long.
IDLE_TIMEOUT = timedelta(days=365)


class KVHandler(Protocol):
    """A worker's KV transfer, as the worker loop drives it (kv_transfer/tp_transport.py)."""

    def info(self) -> dict[str, Any]: ...

    def handle(self, cmd: tuple, reply: Callable[[Any], None]) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(slots=True)
class WorkerSpec:
    """What a worker rank needs to build its shard and answer rank 0."""
    tp_rank: int
    tp_size: int
    config: EngineConfig
    num_blocks: int
    device_index: int
    store_port: int
    # Builds this rank's KV transfer over its cache shard; None without KV transfer. It is
    # pickled into the worker, so a module-level callable (or a partial of one).
    kv_handler: Callable[[KVCache], KVHandler] | None = None


def load_model(config: EngineConfig, folder: Path, local: ModelConfig, dtype: torch.dtype,
               device: torch.device, tp_rank: int = 0) -> LlamaModel:
    """This rank's shard of the weights (all of them without tensor parallelism)."""
    try:
        weights = _weights(config, folder)
        return LlamaModel(local, weights, dtype, device, max(config.max_model_len, 1), tp_rank,
                          all_reduce if config.tensor_parallel_size > 1 else None,
                          config.quantization, cache_dtype(config.kv_cache_dtype, dtype))
    except ValueError as e:
        raise loader.ModelLoadError(f"{folder}: {e}") from None


def model_folder(config: EngineConfig) -> Path:
    """config.model's HF folder (a GGUF file's converted once: config and tokenizer alone
    where --quantization gguf reads its weights from the file). A checkpoint stored
    quantized sets config.quantization to its method, as vLLM reads it; another is refused."""
    folder = loader.resolve(config.model, weights=config.quantization != "gguf")
    if config.load_format != "dummy" and (stored := checkpoint_weights.method(folder)):
        if config.quantization not in (None, stored):
            raise ConfigError(f"{config.model} is stored quantized with {stored}: serve it "
                              f"without --quantization {config.quantization}")
        config.quantization = stored
        config.validate()
    return folder


def _weights(config: EngineConfig, folder: Path) -> Mapping[str, torch.Tensor | Table]:
    if config.load_format == "dummy":
        return loader.dummy_state_dict(folder)
    if config.quantization in CHECKPOINT_QUANTIZATIONS:
        return CheckpointWeights(folder)
    if config.quantization != "gguf":
        return loader.load_state_dict(folder)
    if (file := loader.gguf_file(config.model)) is None:
        raise loader.ModelLoadError(f"--quantization gguf serves a .gguf file as it is stored; "
                                    f"{config.model} is an HF folder (--quantization int8 or "
                                    "int4 quantizes one at load)")
    return GGUFWeights(file, folder)


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum a row-parallel layer's partial outputs over the group (the only one a process
    joins), in place."""
    dist.all_reduce(t)
    return t


class TPGroup:
    """Rank 0's (or a worker's) handle on the tensor-parallel process group."""

    def __init__(self, rank: int, size: int, store: dist.Store, backend: str,
                 device: torch.device) -> None:
        self.rank, self.size = rank, size
        if device.type != "cpu":  # collectives run on the current device
            getattr(torch, device.type).set_device(device)
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=size, timeout=IDLE_TIMEOUT)
        # Commands are pickled Python objects: they travel on a CPU group even on GPUs.
        self.ctrl = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) \
            if backend != "gloo" else dist.group.WORLD
        self.lock = threading.RLock()
        self.procs: list[mp.Process] = []
        self.worker_infos: list[dict] = []  # each worker's KV-transfer info
        self.broken = False

    @classmethod
    def join(cls, procs: list[mp.Process], store: dist.TCPStore, platform: Platform,
             device: torch.device, timeout: float = 300) -> TPGroup:
        """Rank 0: wait until every worker (spawn_workers) has built its shard, then form
        the group with them."""
        infos = _await_workers(store, procs, timeout)
        group = cls(0, len(procs) + 1, store, platform.dist_backend(), device)
        group.procs, group.worker_infos = procs, infos
        atexit.register(group.stop)
        return group

    # -- rank 0 ------------------------------------------------------------------------

    def send(self, cmd: tuple) -> None:
        with self.lock:
            self._broadcast(cmd)

    def call(self, cmd: tuple) -> list[Any]:
        """Broadcast `cmd` and return every worker's answer (ranks 1..T-1)."""
        with self.lock:
            self._broadcast(cmd)
            out: list[Any] = [None] * self.size
            dist.gather_object(None, out, dst=0, group=self.ctrl)
        return out[1:]

    def _broadcast(self, cmd: tuple) -> None:
        if self.broken:  # the ranks' collectives no longer pair up: never send more
            raise RuntimeError("the tensor-parallel group failed mid-step; restart the server")
        dist.broadcast_object_list([cmd], src=0, group=self.ctrl)

    def stop(self) -> None:
        if not self.procs:
            return
        procs, self.procs = self.procs, []
        with suppress(RuntimeError):  # a worker is gone, the group broken: stop by force
            if all(p.is_alive() for p in procs) and not self.broken:
                self.send(("stop",))
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        with suppress(RuntimeError):
            dist.destroy_process_group()

    # -- workers -----------------------------------------------------------------------

    def recv(self) -> tuple:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    def reply(self, obj: Any) -> None:
        dist.gather_object(obj, None, dst=0, group=self.ctrl)


class TPModel:
    """Rank 0's model: every forward is mirrored by the workers on their shards."""

    def __init__(self, model: LlamaModel, group: TPGroup) -> None:
        self.model, self.group = model, group
        self.config = model.config

    def forward(self, batch: Batch, cache: KVCache) -> torch.Tensor:
        with self.group.lock:
            self.group.send(("step", _on_host(batch)))
            try:
                return self.model.forward(batch, cache)
            except Exception:  # the workers may be waiting in an all-reduce of this step
                self.group.broken = True
                raise


def _on_host(batch: Batch) -> Batch:
    """The batch with CPU tensors (it is pickled; each worker moves it to its device)."""
    def cpu(v: Any) -> Any:
        return v.cpu() if isinstance(v, torch.Tensor) else v

    fields = {k: cpu(getattr(batch, k)) for k in batch.__slots__}
    fields["chunks"] = [Chunk(c.start, c.end, c.pos, c.table.cpu()) for c in batch.chunks]
    return Batch(**fields)


def spawn_workers(specs: list[WorkerSpec]) -> list[mp.Process]:
    """Start ranks 1..T-1; they load their shards while rank 0 loads its own."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_worker, args=(s,), name=f"engine-tp{s.tp_rank}",
                         daemon=True) for s in specs]
    for p in procs:
        p.start()
    return procs


def new_store() -> dist.TCPStore:
    """Rank 0's rendezvous (workers report ready or their error here, then form the group)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=60))


def _await_workers(store: dist.TCPStore, procs: list[mp.Process], timeout: float
                   ) -> list[dict]:
    deadline, infos = time.monotonic() + timeout, {}
    while len(infos) < len(procs):
        for rank, proc in enumerate(procs, start=1):
            if rank in infos:
                continue
            if store.check([f"error{rank}"]):
                _kill(procs)
                raise ConfigError(f"tensor-parallel rank {rank}: "
                                  f"{store.get(f'error{rank}').decode()}")
            if store.check([f"ready{rank}"]):
                infos[rank] = json.loads(store.get(f"ready{rank}"))
            elif not proc.is_alive() or time.monotonic() > deadline:
                _kill(procs)
                raise ConfigError(f"tensor-parallel rank {rank} did not start "
                                  "(see its log above)")
        time.sleep(0.05)
    return [infos[r] for r in sorted(infos)]


def _kill(procs: list[mp.Process]) -> None:
    for p in procs:
        p.kill()


def run_worker(spec: WorkerSpec) -> None:
    """Entry point of a tensor-parallel worker rank: build the shard, then obey rank 0."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s "
                        f"tp{spec.tp_rank} %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    cfg = spec.config
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    store = dist.TCPStore("127.0.0.1", spec.store_port, is_master=False,
                          timeout=timedelta(seconds=60))
    try:
        platform = get_platform(cfg.device)
        device = platform.rank_device(spec.device_index)
        folder = model_folder(cfg)
        local = ModelConfig.from_folder(folder).shard(spec.tp_size)
        dtype = loader.TORCH_DTYPES[cfg.dtype]
        cache = KVCache(local.kv_shape(cfg.block_size, cfg.kv_layout), spec.num_blocks,
                        cache_dtype(cfg.kv_cache_dtype, dtype), device)
        kv = spec.kv_handler(cache) if spec.kv_handler is not None else None
        model = load_model(cfg, folder, local, dtype, device, spec.tp_rank)
    except Exception as e:  # whatever fails, rank 0 must hear why, not wait
        store.set(f"error{spec.tp_rank}", str(e) or type(e).__name__)
        return
    store.set(f"ready{spec.tp_rank}", json.dumps(kv.info() if kv else {}))
    group = TPGroup(spec.tp_rank, spec.tp_size, store, platform.dist_backend(), device)
    freeze_heap()
    try:
        _serve(group, model, cache, kv)
    finally:
        if kv is not None:
            kv.close()
    dist.destroy_process_group()


def _serve(group: TPGroup, model: LlamaModel, cache: KVCache, kv: KVHandler | None) -> None:
    while True:
        try:
            cmd = group.recv()
        except RuntimeError:  # rank 0 is gone
            os._exit(0)
        if cmd[0] == "step":
            model.forward(cmd[1].to(cache.tensor.device), cache)
        elif cmd[0] == "stop":
            return
        else:
            kv.handle(cmd, group.reply)
