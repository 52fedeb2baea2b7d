"""One data-parallel engine rank: its own process, engine and step loop, taking commands
from the API server's `DPEngine` (dp_engine.py, which describes the messages) over ZMQ."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import threading

import zmq
from prometheus_client import CollectorRegistry

from pdserve.config import ConfigError, EngineConfig, KVTransferConfig
from pdserve.engine.build import build_engine
from pdserve.engine.engine_loop import EngineLoop
from pdserve.model.loader import ModelLoadError


@dataclasses.dataclass(slots=True)
class RankSpec:
    rank: int
    config: EngineConfig
    kv: KVTransferConfig | None
    side_channel: tuple[str, int]
    inbox: str  # ipc address this rank pulls commands from
    outbox: str  # ipc address all ranks push to


def rank_engine_id(base: str, rank: int) -> str:
    return f"{base}_dp{rank}"


def run_rank(spec: RankSpec) -> None:
    """Entry point of one engine-rank process."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s dp{spec.rank} "
                        "%(name)s: %(message)s")
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    out = ctx.socket(zmq.PUSH)
    out.connect(spec.outbox)
    lock = threading.Lock()

    def send(msg: tuple) -> None:
        with lock:
            out.send(pickle.dumps(msg))

    registry = CollectorRegistry()
    kv = spec.kv
    engine_id = rank_engine_id(kv.engine_id if kv else "local", spec.rank)
    if kv is not None:
        kv = dataclasses.replace(kv, engine_id=engine_id)
    host, base_port = spec.side_channel
    tp = spec.config.tensor_parallel_size
    try:
        loop = EngineLoop(lambda: build_engine(spec.config, kv, registry, engine_id,
                                               (host, base_port + spec.rank * tp),
                                               dp_rank=spec.rank),
                          lambda outs: send(("out", outs)))
    except (ConfigError, ModelLoadError) as e:
        send(("error", spec.rank, str(e)))
        return
    engine = loop.engine
    send(("ready", spec.rank, engine.kv_info(), engine.describe()))
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(spec.inbox)
    while True:
        msg = pickle.loads(inbox.recv())
        if msg[0] == "add":
            loop.add(msg[1])
        elif msg[0] == "abort":
            loop.abort(msg[1])
        elif msg[0] == "expire_leases":
            loop.expire_leases()
        elif msg[0] == "metrics":
            send(("metrics", msg[1], list(registry.collect())))
        else:
            loop.shutdown()
            engine.close()
            return

