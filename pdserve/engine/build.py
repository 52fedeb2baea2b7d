"""Assembles an engine from a configuration: platform, weights, KV cache, tensor-parallel
ranks and the KV connector. The one module that knows both the engine and the connectors
(`serve`, the DP rank processes and `bench offline` build engines here)."""

from __future__ import annotations

import functools
import os

import torch
from prometheus_client import CollectorRegistry

from pdserve.config import ConfigError, EngineConfig, KVTransferConfig
from pdserve.engine.decode_graphs import DecodeGraphs
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampler import Sampler
from pdserve.engine.tensor_parallel import (
    TPGroup,
    TPModel,
    WorkerSpec,
    load_model,
    model_folder,
    new_store,
    spawn_workers,
)
from pdserve.kv_transfer.factory import make_connector
from pdserve.kv_transfer.host_buffer import HostBuffer
from pdserve.kv_transfer.interface import ConnectorContext
from pdserve.kv_transfer.tp_transport import WorkerKV
from pdserve.model import loader
from pdserve.model.kv_cache import KVCache, cache_dtype
from pdserve.model.llama import LlamaModel, ModelConfig
from pdserve.model.tokenizer import Tokenizer
from pdserve.platforms import get_platform

DEFAULT_SIDE_CHANNEL = ("127.0.0.1", 5600)


def build_engine(config: EngineConfig, kv: KVTransferConfig | None = None,
                 registry: CollectorRegistry | None = None, engine_id: str = "",
                 side_channel: tuple[str, int] = DEFAULT_SIDE_CHANNEL,
                 dp_rank: int = 0) -> LLMEngine:
    """`side_channel`: where TP rank 0 answers decodes (rank r at port + r)."""
    config.validate()
    tp = config.tensor_parallel_size
    if tp > 1 and config.num_threads is None:  # ranks share cores
        config.num_threads = max(1, len(os.sched_getaffinity(0)) // tp)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    try:
        platform = get_platform(config.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    device = platform.rank_device(dp_rank * tp) if tp > 1 else platform.device()
    folder = model_folder(config)
    model_config = ModelConfig.from_folder(folder)
    if (limit := model_config.long_rope_limit()) and config.max_model_len > limit:
        raise ConfigError(f"{config.model}: past {limit} tokens (its "
                          "original_max_position_embeddings) transformers computes a sequence "
                          "again with LongRoPE's long factors, which pdserve does not "
                          f"implement; serve it with --max-model-len {limit} or less")
    tokenizer = Tokenizer.from_folder(loader.tokenizer_folder(folder),
                                      list(model_config.eos_token_ids))
    dtype = loader.TORCH_DTYPES[config.dtype]
    try:
        local = model_config.shard(tp)
    except ValueError as e:
        raise ConfigError(f"{config.model or loader.EMBEDDED_NAME}: {e}") from None
    shape = local.kv_shape(config.block_size, config.kv_layout)
    kv_dtype = cache_dtype(config.kv_cache_dtype, dtype)
    num_blocks = config.num_kv_blocks or int(
        config.kv_cache_memory_gib * 2**30 // shape.block_bytes(kv_dtype))
    engine_id = engine_id or (kv.engine_id if kv else "local")
    if kv is not None:
        HostBuffer.needed(kv, platform)  # refuse what cannot work before any rank starts
    if tp > 1:  # the workers load their shards while this rank loads its own
        store = new_store()
        workers = spawn_workers([
            WorkerSpec(r, tp, config, num_blocks, dp_rank * tp + r, store.port,
                       _worker_kv(kv, engine_id, side_channel, tp, r, platform.name))
            for r in range(1, tp)])
    model = load_model(config, folder, local, dtype, device)
    group = TPGroup.join(workers, store, platform, device) if tp > 1 else None
    cache = KVCache(shape, num_blocks, kv_dtype, device)
    connector = None
    if kv is not None:
        ctx = ConnectorContext(engine_id, dp_rank, tp, config.block_size, cache.block_bytes,
                               tokenizer.vocab_size, local.layer_windows)
        connector = make_connector(kv, ctx, cache, platform, side_channel, group, registry)
    runner = ModelRunner(TPModel(model, group) if group else model, cache, Sampler(config.seed),
                         _graphs(config, model, cache))
    return LLMEngine(config, runner, tokenizer, connector, registry, engine_id, dp_rank,
                     on_close=group.stop if group else None)


def _graphs(config: EngineConfig, model: LlamaModel, cache: KVCache) -> DecodeGraphs | None:
    """CUDA graphs for decode steps on one CUDA device. Eager elsewhere: under tensor
    parallelism (the all-reduces would have to be captured too) and for mixtures of experts
    (their routing counts tokens per expert on the host)."""
    if (config.enforce_eager or cache.tensor.device.type != "cuda"
            or config.tensor_parallel_size > 1 or model.config.moe_layers):
        return None
    return DecodeGraphs(model, cache, config.max_num_seqs,
                        -(-config.max_model_len // config.block_size),
                        scratch=cache.num_blocks - 1, capture=True)


def _worker_kv(kv: KVTransferConfig | None, engine_id: str, side_channel: tuple[str, int],
               tp_size: int, tp_rank: int, device: str) -> functools.partial | None:
    """What builds TP worker `tp_rank`'s KV transfer (it answers at port + tp_rank)."""
    if kv is None:
        return None
    host, port = side_channel
    return functools.partial(WorkerKV.build, kv, engine_id, (host, port + tp_rank), tp_size,
                             tp_rank, device)
