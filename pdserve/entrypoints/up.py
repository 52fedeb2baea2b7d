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
import tempfile
import time
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry, start_http_server

from pdserve.engine import core_loan
from pdserve.entrypoints.routing import add_routing_args, check_routing_args, routing_argv
from pdserve.entrypoints.serve import add_engine_args, add_server_args
from pdserve.entrypoints.supervisor import Supervisor

log = logging.getLogger("pdserve.up")
UP_MAX_PREFILL_QUEUE = 3  # proxy --max-prefill-queue under pdserve up (docs/benchmarks.md)
# A decode prefills only what overflows the prefills, recomputes and short prompts; every
# step of that stalls its streams, so it takes prompts in smaller chunks (docs/benchmarks.md).
UP_DECODE_PROMPT_BUDGET = 128
LOAN_NICE = 10  # a prefill's, where it borrows decodes' cores: on them the decode comes first


@dataclass(slots=True)
class Instance:
    name: str
    argv: list[str]
    url: str
    env: dict[str, str]
    cpus: set[int] | None = None
    nice: int = 0
    # What says it is alive: the proxy's /health also judges its backends, which may be
    # restarting; its /metrics answers while its own loop runs.
    probe: str = "/health"
    proc: subprocess.Popen | None = None


def add_parser(sub) -> None:
    p = sub.add_parser("up", help="start prefill + decode + proxy on this host",
                       description="Start N prefill and M decode instances of `pdserve serve` "
                       "and a proxy in front; Ctrl-C stops them all.")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument("--prefill-dp", type=int, default=1, help="engine ranks per prefill")
    p.add_argument("--decode-dp", type=int, default=1, help="engine ranks per decode")
    p.add_argument("--prefill-tp", type=int, default=1,
                   help="tensor-parallel ranks per prefill engine (needs the HND KV layout, "
                   "the default, when it differs from --decode-tp)")
    p.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel ranks per decode "
                   "engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the proxy's port")
    p.add_argument("--base-port", type=int, default=8100, help="first instance's HTTP port")
    p.add_argument("--side-channel-base-port", type=int, default=5600)
    add_routing_args(p)
    # Where the prefills fall behind, the decodes prefill the overflow themselves (as a
    # monolith would) rather than sit on spare compute while TTFT grows without bound.
    p.set_defaults(max_prefill_queue=UP_MAX_PREFILL_QUEUE)
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--metrics-port", type=int, default=None,
                   help="where up serves its own metrics (restarts); default: --base-port - 1")
    p.add_argument("--decode-max-num-batched-tokens", type=int,
                   default=UP_DECODE_PROMPT_BUDGET, metavar="N",
                   help="prompt tokens per step on a decode instance, which prefills only "
                   "overflow, recomputes and short prompts while its streams wait (the "
                   "prefills take --max-num-batched-tokens)")
    p.add_argument("--core-loan", action=argparse.BooleanOptionalAction, default=True,
                   help="a prefill computes on the decodes' cores while they have nothing "
                   "to decode (default: on)")
    add_engine_args(p)
    add_server_args(p)
    p.set_defaults(run=run)


def plan(args: argparse.Namespace, engine_argv: list[str], boards: str | None = None
         ) -> list[Instance]:
    """Lay out ports and cores (see `share_cores`, and `plan_loans` where `boards` names a
    folder for the core-loan boards). Each instance takes dp * tp consecutive side-channel
    ports (one per rank)."""
    cores = share_cores(sorted(os.sched_getaffinity(0)), args.prefill,
                        args.prefill_dp * args.prefill_tp, args.decode,
                        args.decode_dp * args.decode_tp)
    loans = plan_loans(args, cores, boards) if boards else {}
    out: list[Instance] = []
    port, side = args.base_port, args.side_channel_base_port
    for role, count, dp, tp in (("prefill", args.prefill, args.prefill_dp, args.prefill_tp),
                                ("decode", args.decode, args.decode_dp, args.decode_tp)):
        for i in range(count):
            kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                  "engine_id": f"{role}{i}"}
            cpus, threads, nice = cores[role][i]
            # OMP threads that spin while idle would steal the other tier's core.
            env = {"OMP_WAIT_POLICY": "PASSIVE"}
            if loan := loans.get(f"{role}{i}"):
                env[core_loan.ENV] = json.dumps(loan)
                if role == "prefill":
                    cpus, nice = cpus | set(loan["borrow"]["cpus"]), LOAN_NICE
            argv = [sys.executable, "-m", "pdserve.entrypoints.cli", "serve",
                    "--host", args.host, "--port", str(port),
                    "--kv-transfer-config", json.dumps(kv), "--data-parallel-size", str(dp),
                    "--tensor-parallel-size", str(tp),
                    "--kv-side-channel-host", args.host,
                    "--kv-side-channel-port", str(side), *engine_argv]
            if role == "decode":  # after engine_argv: the last flag given wins
                argv += ["--max-num-batched-tokens", str(args.decode_max_num_batched_tokens)]
            argv += ["--num-threads", str(threads)]
            inst = Instance(f"{role}{i}", argv, f"http://{args.host}:{port}", env, cpus, nice)
            if args.api_key:
                inst.argv += ["--api-key", args.api_key]
            out.append(inst)
            port += 1
            side += dp * tp
    prefills = [i.url for i in out if i.name.startswith("prefill")]
    decodes = [i.url for i in out if i.name.startswith("decode")]
    proxy = [sys.executable, "-m", "pdserve.entrypoints.cli", "proxy", "--host", args.host,
             "--port", str(args.port), *routing_argv(args),
             "--max-request-bytes", str(args.max_request_bytes),
             "--prefill", *prefills, "--decode", *decodes]
    if args.api_key:
        proxy += ["--api-key", args.api_key]
    # The proxy relays every token: on the prefills' cores it takes none from a decode's.
    spare = [c for c, _, _ in cores["prefill"]]
    out.append(Instance("proxy", proxy, f"http://{args.host}:{args.port}", {},
                        set().union(*spare) if None not in spare else None, probe="/metrics"))
    return out


def share_cores(cpus: list[int], prefills: int, prefill_ranks: int, decodes: int,
                decode_ranks: int) -> dict[str, list[tuple[set[int] | None, int, int]]]:
    """(cores, threads per rank, nice) of each instance. Every decode rank gets a core of its
    own, from the top, and one thread: a decode step is latency-bound and must never wait
    for a prefill. The prefills split the cores left over between them, so their threads do
    not straggle behind a decode on a shared core (a parallel region runs at the pace of its
    slowest thread); where no core is left they share all of them at a lower priority."""
    n_dec = decodes * decode_ranks
    top = [cpus[-1 - r % len(cpus)] for r in range(n_dec)]
    decode = [({*top[i * decode_ranks:(i + 1) * decode_ranks]}, 1, 0) for i in range(decodes)]
    rest = [c for c in cpus if c not in top]
    share = len(rest) // prefills if prefills else 0
    if share:
        prefill = [({*rest[i * share:(i + 1) * share]}, max(1, share // prefill_ranks), 0)
                   for i in range(prefills)]
    else:
        prefill = [(None, max(1, len(cpus) // prefill_ranks), 10 if len(cpus) > 1 else 0)
                   ] * prefills
    return {"prefill": prefill, "decode": decode}


def plan_loans(args: argparse.Namespace, cores: dict, boards: str) -> dict[str, dict]:
    """Each instance's core-loan spec (engine/core_loan.py), and the boards, made in folder
    `boards` and named for their borrower: decode j lends its cores to prefill j % P, the
    (j // P)-th decode on that prefill's board, with a slot per rank (the board has a byte
    per lent core, at least as many); a prefill that serves a single decode of one rank
    lends that decode its own cores. Only prefills with cores of their own and a single
    engine (no ranks to split a loan between) take part."""
    if args.prefill_dp * args.prefill_tp > 1 or any(c is None for c, _, _ in cores["prefill"]):
        return {}
    loans: dict[str, dict] = {}
    for j, (cpus, threads, _) in enumerate(cores["decode"]):
        prefill = loans.setdefault(f"prefill{j % args.prefill}", {"borrow": {
            "board": os.path.join(boards, f"prefill{j % args.prefill}"), "cpus": []}})
        loans[f"decode{j}"] = {"lend": {"board": prefill["borrow"]["board"],
                                        "slot": j // args.prefill * args.decode_dp,
                                        "threads": threads * args.decode_tp, "paced": True}}
        prefill["borrow"]["cpus"] += sorted(cpus)
    if args.decode <= args.prefill and args.decode_dp * args.decode_tp == 1:
        for j in range(args.decode):
            cpus, threads, _ = cores["prefill"][j]
            board = os.path.join(boards, f"decode{j}")
            loans[f"decode{j}"]["borrow"] = {"board": board, "cpus": sorted(cpus)}
            loans[f"prefill{j}"]["lend"] = {"board": board, "slot": 0, "threads": threads,
                                            "paced": False}
    for borrow in (loan["borrow"] for loan in loans.values() if "borrow" in loan):
        core_loan.new_board(borrow["board"], len(borrow["cpus"]))
    return loans


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags given to `up`, passed through to every instance."""
    flags = ["model", "dtype", "device", "block_size", "kv_cache_memory", "num_kv_blocks",
             "kv_layout", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "seed",
             "served_model_name", "max_queue", "request_timeout", "drain_timeout",
             "max_request_bytes", "quantization", "load_format", "kv_cache_dtype"]
    argv: list[str] = []
    for f in flags:
        if (v := getattr(args, f)) is not None:
            argv += [f"--{f.replace('_', '-')}", *map(str, v if isinstance(v, list) else [v])]
    return argv + ["--enforce-eager"] * args.enforce_eager


def run(args: argparse.Namespace) -> int:
    if min(args.prefill, args.decode, args.prefill_dp, args.decode_dp, args.prefill_tp,
           args.decode_tp, args.decode_max_num_batched_tokens) < 1:
        print("pdserve: error: --prefill, --decode, their -dp and -tp sizes and "
              "--decode-max-num-batched-tokens must be at least 1", file=sys.stderr)
        return 2
    if problem := check_routing_args(args):
        print(f"pdserve: error: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pdserve-up-") as boards:
        return _run(args, plan(args, engine_argv(args), boards if args.core_loan else None))


def _run(args: argparse.Namespace, instances: list[Instance]) -> int:
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
            # Asked to stop before this loop saw every instance healthy (a client may have
            # seen the proxy healthy first) is a clean stop, not a failed start.
            return 0 if stopping else 1
        print(f"pdserve up: {args.prefill} prefill + {args.decode} decode ready; "
              f"send requests to {instances[-1].url}/v1", flush=True)
        registry = CollectorRegistry()
        supervisor = Supervisor(instances, _start, _kill, args.startup_timeout, registry)
        _serve_metrics(registry, args.host, args.metrics_port or args.base_port - 1)
        try:
            while not stopping:  # instances that die come back; up stops on its signal
                supervisor.check()
                time.sleep(0.5)
        finally:
            supervisor.close()
        return 0
    finally:  # SIGTERM to each: servers drain, the proxy finishes its open streams
        _stop_all(instances, args.drain_timeout + 10)


def _start(inst: Instance) -> None:
    def pre() -> None:
        if inst.cpus:
            os.sched_setaffinity(0, inst.cpus)
        if inst.nice:
            os.nice(inst.nice)

    # Its own process group, so stopping it takes any children along. Not its own session:
    # Linux gives each session a scheduling autogroup, and a nice value ranks a process only
    # inside its autogroup, so a prefill's nice would not yield to a decode's threads.
    inst.proc = subprocess.Popen(inst.argv, env={**os.environ, **inst.env}, preexec_fn=pre,
                                 process_group=0, stdin=subprocess.DEVNULL)
    log.info("started %s (pid %d) at %s", inst.name, inst.proc.pid, inst.url)


def _kill(inst: Instance) -> None:
    """SIGKILL and reap: its ports are free for the instance started in its place."""
    _signal(inst, signal.SIGKILL)
    inst.proc.wait()


def _serve_metrics(registry: CollectorRegistry, host: str, port: int) -> None:
    try:
        start_http_server(port, host, registry)
        log.info("up's metrics at http://%s:%d/metrics", host, port)
    except OSError as e:  # a port taken costs the metrics, not the instances
        log.warning("up's metrics not served: port %d: %s", port, e)


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
