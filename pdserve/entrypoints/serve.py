"""`pdserve serve`: one engine behind the OpenAI-compatible API.

The engine and the HTTP stack are imported inside the functions that start them: every
`pdserve` command registers its arguments here, and most (`proxy`, `up`, `--help`) must
start without importing torch."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pdserve.config import (
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    ConfigError,
    EngineConfig,
    KVTransferConfig,
)
from pdserve.entrypoints.body_limit import add_body_limit_arg, check_body_limit

log = logging.getLogger("pdserve.serve")


# A GPU computes a 2048-token step of a small model in a few ms: larger prefill steps there
# cost running streams little and re-read the weights less often.
ACCELERATOR_STEP_BUDGET = 2048


def _step_budget(device: str) -> int:
    from pdserve.platforms import get_platform

    try:
        cpu = device == "cpu" or get_platform(device).name == "cpu"
    except ValueError:
        cpu = True  # the engine's build reports the device
    return EngineConfig().max_num_batched_tokens if cpu else ACCELERATOR_STEP_BUDGET


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=None,
                   help="HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 where the CPU has bf16 instructions, else float32")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "xpu"])
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--kv-cache-memory", type=float, default=d.kv_cache_memory_gib,
                   help="GiB of KV cache (default %(default)s)")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-layout", default=d.kv_layout, choices=["NHD", "HND"])
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prompt tokens a step may prefill (running decodes ride along; "
                        f"default {d.max_num_batched_tokens} on CPU, "
                        f"{ACCELERATOR_STEP_BUDGET} on an accelerator)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching,
                   help="reuse the KV of prompt prefixes seen before (--no-prefix-caching: off)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="launch every decode step's kernels from Python: no CUDA graphs "
                        "(CPUs run eagerly anyway)")
    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATIONS,
                   help="int8, int4: every weight quantized at load, in groups of 32 (GGUF's "
                        "Q8_0 or Q4_0), and multiplied quantized against rows of x quantized "
                        "on the fly; gguf: a .gguf file's weights computed as stored; a "
                        "checkpoint stored quantized (compressed-tensors, gptq, awq, fp8) is "
                        "computed as stored without it (CPU)")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="auto: --dtype; fp8 (e4m3) or fp8_e5m2: K and V stored in 8 bits, "
                        "read back for attention (CPU; a P/D pair must agree)")
    p.add_argument("--load-format", default=d.load_format, choices=LOAD_FORMATS,
                   help="dummy: random weights of the shape config.json gives (a folder "
                        "with config.json and a tokenizer): for benchmarks")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's names in the API (the first in responses; default: "
                        "the model's own)")


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Limits of the HTTP server in front of the engine (`serve`, and `up` passes them on)."""
    p.add_argument("--max-queue", type=int, default=None,
                   help="requests that may wait beyond the running ones (max-num-seqs per "
                        "rank); more get 429 (default: no limit)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take before it is aborted with a 504 "
                        "(default: no limit; a request may ask for less: request_timeout)")
    add_body_limit_arg(p)
    p.add_argument("--drain-timeout", type=float, default=30,
                   help="on SIGTERM, seconds running requests get to finish before they are "
                        "aborted (default %(default)s)")


def check_server_args(args: argparse.Namespace) -> None:
    if args.max_queue is not None and args.max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ConfigError(f"--request-timeout must be positive, got {args.request_timeout}")
    if problem := check_body_limit(args.max_request_bytes):
        raise ConfigError(problem)
    if args.drain_timeout < 0:
        raise ConfigError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from pdserve.platforms.cpu import default_dtype

    cfg = EngineConfig(
        model=args.model, dtype=default_dtype() if args.dtype == "auto" else args.dtype,
        device=args.device, block_size=args.block_size,
        kv_cache_memory_gib=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
        kv_layout=args.kv_layout, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=_step_budget(args.device) if args.max_num_batched_tokens is None
        else args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_caching, num_threads=args.num_threads,
        seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager, quantization=args.quantization,
        load_format=args.load_format, kv_cache_dtype=args.kv_cache_dtype)
    cfg.validate()
    return cfg


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_engine_args(p)
    add_server_args(p)
    p.add_argument("--kv-transfer-config",
                   default=os.environ.get("PDSERVE_KV_TRANSFER_CONFIG") or None,
                   help='JSON, e.g. {"kv_connector":"NixlConnector","kv_role":"kv_both"} '
                        "(env PDSERVE_KV_TRANSFER_CONFIG); its side_channel_secret defaults "
                        "to env PDSERVE_SIDE_CHANNEL_SECRET")
    p.add_argument("--kv-side-channel-host",
                   default=os.environ.get("PDSERVE_KV_SIDE_CHANNEL_HOST", "127.0.0.1"))
    p.add_argument("--kv-side-channel-port", type=int,
                   default=int(os.environ.get("PDSERVE_KV_SIDE_CHANNEL_PORT", "5600")))
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine ranks behind this server, each its own process")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="processes sharding each engine's layers (heads, MLP); the model's "
                   "heads and KV heads must divide by it")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require this Bearer key on /v1/* (env PDSERVE_API_KEY)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pdserve.entrypoints.admission import Admission
    from pdserve.entrypoints.api_server import build_app
    from pdserve.entrypoints.drain import DrainingServer
    from pdserve.entrypoints.protocol import SERVER_KEEP_ALIVE_S
    from pdserve.model.loader import ModelLoadError

    cfg = engine_config(args)
    check_server_args(args)
    kv = KVTransferConfig.from_json(args.kv_transfer_config) if args.kv_transfer_config \
        else None
    if kv is not None and kv.kv_connector_extra_config.side_channel_secret is None:
        # From a secret store, not the command line (which `ps` and pod specs show).
        kv.kv_connector_extra_config.side_channel_secret = \
            os.environ.get("PDSERVE_SIDE_CHANNEL_SECRET")
    if args.data_parallel_size < 1:
        raise ConfigError("--data-parallel-size must be at least 1")
    try:
        state = _dp_state(args, cfg, kv) if args.data_parallel_size > 1 \
            else _local_state(args, cfg, kv)
    except ModelLoadError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    state.admission = Admission(cfg.max_num_seqs * args.data_parallel_size, args.max_queue)
    state.request_timeout = args.request_timeout
    state.max_request_bytes = args.max_request_bytes
    state.release_remote = _remote_releaser(kv, state.validate_kv_params)
    formats = [cfg.dtype, *([f"{cfg.quantization} weights"] if cfg.quantization else []),
               *([f"KV {cfg.kv_cache_dtype}"] if cfg.kv_cache_dtype != "auto" else [])]
    log.info("serving %s (%s; %s) at http://%s:%d", " ".join(state.names), ", ".join(formats),
             state.engine.describe(), args.host, args.port)
    config = uvicorn.Config(build_app(state), host=args.host, port=args.port,
                            timeout_keep_alive=SERVER_KEEP_ALIVE_S,
                            log_level="warning")
    try:
        DrainingServer(config, state, args.drain_timeout).run()
    finally:
        state.engine.shutdown()
    return 0


def _remote_releaser(kv: KVTransferConfig | None, validate):
    """For a decode: tells a prefill to free the blocks of a request refused here."""
    if kv is None or not kv.is_consumer:
        return None
    from pdserve.kv_transfer import side_channel
    from pdserve.kv_transfer.params import KVParams

    x = kv.kv_connector_extra_config

    def release(p: KVParams) -> None:
        # Refused params may point anywhere: only where a pull could have gone.
        if p.complete and p.remote_request_id is not None and \
                validate.host_allowed(p.remote_host):
            side_channel.release_quietly(p.remote_host, p.remote_port, p.remote_request_id,
                                         x.handshake_timeout, x.side_channel_secret)
    return release


def _local_state(args, cfg: EngineConfig, kv: KVTransferConfig | None):
    from prometheus_client import CollectorRegistry

    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.engine.build import build_engine

    registry = CollectorRegistry()
    side = (args.kv_side_channel_host, args.kv_side_channel_port)
    engine = AsyncEngine(lambda: build_engine(cfg, kv, registry, side_channel=side), registry)
    # One compile cache for the handlers and the engine.
    return _state(args, cfg, kv, engine, engine.engine.tokenizer, engine.engine.grammars)


def _dp_state(args, cfg: EngineConfig, kv: KVTransferConfig | None):
    from pdserve.engine.dp_engine import DPEngine
    from pdserve.engine.structured import Grammars
    from pdserve.engine.tensor_parallel import model_folder
    from pdserve.model import loader
    from pdserve.model.llama import ModelConfig
    from pdserve.model.tokenizer import Tokenizer

    # converts a GGUF once, before the ranks start
    folder = model_folder(cfg)
    model = ModelConfig.from_folder(folder)
    tokenizer = Tokenizer.from_folder(loader.tokenizer_folder(folder), list(model.eos_token_ids))
    if cfg.num_threads is None:  # the ranks share the cores
        cfg.num_threads = max(1, len(os.sched_getaffinity(0)) // args.data_parallel_size
                              // cfg.tensor_parallel_size)
    side = (args.kv_side_channel_host, args.kv_side_channel_port)
    # Checks specs before they reach a rank; each rank compiles (once) in its own process.
    return _state(args, cfg, kv, DPEngine(cfg, kv, args.data_parallel_size, side), tokenizer,
                  Grammars(tokenizer, model.vocab_size))


def _state(args, cfg: EngineConfig, kv: KVTransferConfig | None, engine, tokenizer,
           grammars):
    from pdserve.entrypoints.api_server import ServerState
    from pdserve.kv_transfer.params import ParamsValidator
    from pdserve.model.loader import model_name

    validate = ParamsValidator.of(kv, cfg.block_size, tokenizer.vocab_size,
                                  args.kv_side_channel_host) if kv is not None else None
    return ServerState(engine, tokenizer, model_name(cfg.model), cfg.max_model_len, grammars,
                       validate_kv_params=validate, kv_info=engine.kv_info if kv else None,
                       api_key=args.api_key, served_model_names=args.served_model_name or [])
