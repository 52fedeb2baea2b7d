"""`pdserve up`: prefill and decode instances plus the proxy on this host, with the cores
shared out on purpose, in one command."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from pdserve.entrypoints.routing import add_routing_args, check_routing_args, routing_argv

log = logging.getLogger("pdserve.up")


@dataclass(slots=True)
class Instance:
    name: str
    argv: list[str]
    url: str
    env: dict[str, str]
    cpus: set[int] | None = None
    nice: int = 0
    proc: subprocess.Popen | None = None


def add_parser(sub) -> None:
    from pdserve.entrypoints.serve import add_engine_args, add_server_args

    p = sub.add_parser("up", help="start prefill + decode + proxy on this host",
                       description="Start N prefill and M decode instances of `pdserve serve` "
                       "and a proxy in front; Ctrl-C stops them all.")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument("--prefill-dp", type=int, default=1, help="engine ranks per prefill")
    p.add_argument("--decode-dp", type=int, default=1, help="engine ranks per decode")
    p.add_argument("--prefill-tp", type=int, default=1,
                   help="tensor-parallel ranks per prefill engine (needs --kv-layout HND "
                   "when it differs from --decode-tp)")
    p.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel ranks per decode "
                   "engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the proxy's port")
    p.add_argument("--base-port", type=int, default=8100, help="first instance's HTTP port")
    p.add_argument("--side-channel-base-port", type=int, default=5600)
    add_routing_args(p)
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    p.add_argument("--startup-timeout", type=float, default=300)
    add_engine_args(p)
    add_server_args(p)
    p.set_defaults(run=run)


def plan(args: argparse.Namespace, engine_argv: list[str]) -> list[Instance]:
    """Lay out ports and cores: decode ranks get cores of their own (one thread each, from
    the top), prefills all cores at a lower priority, so a decode step never waits for a
    prefill. Each instance takes dp * tp consecutive side-channel ports (one per rank)."""
    cpus = sorted(os.sched_getaffinity(0))
    out: list[Instance] = []
    port, side, next_core = args.base_port, args.side_channel_base_port, 0
    # OMP threads that spin while idle would steal the decode's core.
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    for role, count, dp, tp in (("prefill", args.prefill, args.prefill_dp, args.prefill_tp),
                                ("decode", args.decode, args.decode_dp, args.decode_tp)):
        for i in range(count):
            kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                  "engine_id": f"{role}{i}"}
            argv = [sys.executable, "-m", "pdserve.entrypoints.cli", "serve",
                    "--host", args.host, "--port", str(port),
                    "--kv-transfer-config", json.dumps(kv), "--data-parallel-size", str(dp),
                    "--tensor-parallel-size", str(tp),
                    "--kv-side-channel-host", args.host,
                    "--kv-side-channel-port", str(side), *engine_argv]
            url = f"http://{args.host}:{port}"
            if role == "decode":
                cores = {cpus[-1 - (next_core + r) % len(cpus)] for r in range(dp * tp)}
                next_core += dp * tp
                inst = Instance(f"{role}{i}", [*argv, "--num-threads", "1"], url, env, cores)
            else:
                threads = max(1, len(cpus) // (dp * tp))
                inst = Instance(f"{role}{i}", [*argv, "--num-threads", str(threads)], url, env,
                                None, nice=10 if len(cpus) > 1 else 0)
            if args.api_key:
                inst.argv += ["--api-key", args.api_key]
            out.append(inst)
            port += 1
            side += dp * tp
    prefills = [i.url for i in out if i.name.startswith("prefill")]
    decodes = [i.url for i in out if i.name.startswith("decode")]
    proxy = [sys.executable, "-m", "pdserve.entrypoints.cli", "proxy", "--host", args.host,
             "--port", str(args.port), *routing_argv(args),
             "--prefill", *prefills, "--decode", *decodes]
    if args.api_key:
        proxy += ["--api-key", args.api_key]
    out.append(Instance("proxy", proxy, f"http://{args.host}:{args.port}", {}))
    return out


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags given to `up`, passed through to every instance."""
    flags = ["model", "dtype", "device", "block_size", "kv_cache_memory", "num_kv_blocks",
             "kv_layout", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "seed",
             "served_model_name", "max_queue", "request_timeout", "drain_timeout"]
    argv: list[str] = []
    for f in flags:
        if (v := getattr(args, f)) is not None:
            argv += [f"--{f.replace('_', '-')}", *map(str, v if isinstance(v, list) else [v])]
    return argv


def run(args: argparse.Namespace) -> int:
    if min(args.prefill, args.decode, args.prefill_dp, args.decode_dp, args.prefill_tp,
           args.decode_tp) < 1:
        print("pdserve: error: --prefill, --decode and their -dp and -tp sizes must be at "
              "least 1", file=sys.stderr)
        return 2
    if problem := check_routing_args(args):
        print(f"pdserve: error: {problem}", file=sys.stderr)
        return 2
    instances = plan(args, engine_argv(args))
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for inst in instances:
            _start(inst)
        if not _wait_healthy(instances, args.startup_timeout, lambda: stopping):
            return 1
        print(f"pdserve up: {args.prefill} prefill + {args.decode} decode ready; "
              f"send requests to {instances[-1].url}/v1", flush=True)
        while not stopping:
            if (dead := [i for i in instances if i.proc.poll() is not None]):
                log.error("%s exited with %s; stopping everything", dead[0].name,
                          dead[0].proc.returncode)
                return 1
            time.sleep(0.5)
        return 0
    finally:  # SIGTERM to each: servers drain, the proxy finishes its open streams
        _stop_all(instances, args.drain_timeout + 10)


def _start(inst: Instance) -> None:
    def pre() -> None:
        os.setsid()  # own process group, so stopping it takes any children along
        if inst.cpus:
            os.sched_setaffinity(0, inst.cpus)
        if inst.nice:
            os.nice(inst.nice)

    inst.proc = subprocess.Popen(inst.argv, env={**os.environ, **inst.env}, preexec_fn=pre)
    log.info("started %s (pid %d) at %s", inst.name, inst.proc.pid, inst.url)


def _wait_healthy(instances: list[Instance], timeout: float, stopping) -> bool:
    deadline = time.monotonic() + timeout
    pending = list(instances)
    while pending and not stopping():
        for inst in list(pending):
            if inst.proc.poll() is not None:
                log.error("%s exited during start-up with code %s", inst.name,
                          inst.proc.returncode)
                return False
            try:
                if httpx.get(inst.url + "/health", timeout=1).status_code == 200:
                    pending.remove(inst)
            except httpx.TransportError:
                pass
        if time.monotonic() > deadline:
            log.error("not healthy after %.0fs: %s", timeout, ", ".join(i.name for i in pending))
            return False
        time.sleep(0.3)
    return not pending


def _stop_all(instances: list[Instance], timeout: float) -> None:
    live = [i for i in instances if i.proc is not None and i.proc.poll() is None]
    for inst in live:
        _signal(inst, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for inst in live:
        try:
            inst.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _signal(inst, signal.SIGKILL)
            inst.proc.wait()


def _signal(inst: Instance, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(inst.proc.pid, sig)
