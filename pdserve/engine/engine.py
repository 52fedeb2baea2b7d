"""The engine: model, paged KV cache, scheduler and sampler driven one step at a time.

Single-threaded by design: only the step-loop thread calls into it."""

from __future__ import annotations

import logging
import os
import time

import torch
from prometheus_client import CollectorRegistry

from pdserve.config import ConfigError, EngineConfig, KVTransferConfig
from pdserve.engine.block_allocator import BlockAllocator
from pdserve.engine.detokenizer import Detokenizer
from pdserve.engine.metrics import EngineMetrics
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request, RequestOutput, Status, TopLogprobs
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import Schedule, Scheduler
from pdserve.engine.tensor_parallel import (
    TPGroup,
    TPModel,
    WorkerSpec,
    load_model,
    new_store,
    spawn_workers,
)
from pdserve.model import loader
from pdserve.model.kv_cache import KVCache
from pdserve.model.llama import ModelConfig
from pdserve.model.tokenizer import Tokenizer
from pdserve.platforms import get_platform

log = logging.getLogger("pdserve.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_config: KVTransferConfig | None = None,
                 registry: CollectorRegistry | None = None, engine_id: str = "",
                 side_channel: tuple[str, int] = ("127.0.0.1", 5600), dp_rank: int = 0) -> None:
        config.validate()
        if config.tensor_parallel_size > 1 and config.num_threads is None:  # ranks share cores
            config.num_threads = max(1, len(os.sched_getaffinity(0))
                                     // config.tensor_parallel_size)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.dp_rank = dp_rank
        try:
            self.platform = get_platform(config.device)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        tp = config.tensor_parallel_size
        self.device = self.platform.rank_device(dp_rank * tp) if tp > 1 else \
            self.platform.device()
        folder = loader.resolve(config.model)
        try:
            self.model_config = ModelConfig.from_hf(loader.load_config(folder))
        except (KeyError, ValueError) as e:
            raise loader.ModelLoadError(f"{folder / 'config.json'}: {e}") from None
        self.tokenizer = Tokenizer.from_folder(folder, list(self.model_config.eos_token_ids))
        self.dtype = DTYPES[config.dtype]
        try:
            local = self.model_config.shard(tp)
        except ValueError as e:
            raise ConfigError(f"{config.model or loader.EMBEDDED_NAME}: {e}") from None
        shape = local.kv_shape(config.block_size, config.kv_layout)
        num_blocks = config.num_kv_blocks or int(
            config.kv_cache_memory_gib * 2**30 // shape.block_bytes(self.dtype))
        self.tp_group = None
        if tp > 1:
            store = new_store()
            workers = spawn_workers(self._worker_specs(kv_config, engine_id, side_channel,
                                                       num_blocks, store.port))
        model = load_model(config, folder, local, self.dtype, self.device)
        if tp > 1:
            self.tp_group = TPGroup.join(workers, store, self.platform, self.device)
        self.cache = KVCache(shape, num_blocks, self.dtype, self.device)
        self.allocator = BlockAllocator(num_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.allocator)
        self.runner = ModelRunner(TPModel(model, self.tp_group) if self.tp_group else model,
                                  self.cache, Sampler(config.seed))
        self.engine_id = engine_id or (kv_config.engine_id if kv_config else "local")
        self.metrics = EngineMetrics(registry or CollectorRegistry(), self.engine_id)
        self.metrics.blocks_total.set(num_blocks)
        self.requests: dict[str, Request] = {}
        self.detok: dict[str, Detokenizer] = {}
        self.connector = None
        self.last_step_computed = False  # did the last step run the model?
        self.last_step_prefilled = False  # ... on prompt tokens (not only decodes)?
        if kv_config is not None:
            from pdserve.kv_transfer.factory import make_connector
            self.connector = make_connector(kv_config, self, registry, side_channel)
        self._update_gauges()

    def _worker_specs(self, kv: KVTransferConfig | None, engine_id: str,
                      side_channel: tuple[str, int], num_blocks: int, store_port: int
                      ) -> list[WorkerSpec]:
        c, (host, port) = self.config, side_channel
        engine_id = engine_id or (kv.engine_id if kv else "local")
        return [WorkerSpec(r, c.tensor_parallel_size, c, kv, engine_id, self.dp_rank,
                           (host, port + r), num_blocks,
                           self.dp_rank * c.tensor_parallel_size + r, store_port)
                for r in range(1, c.tensor_parallel_size)]

    def close(self) -> None:
        """Stop the tensor-parallel workers (the step loop must be stopped first)."""
        if self.tp_group is not None:
            self.tp_group.stop()

    def describe(self) -> str:
        tp = self.config.tensor_parallel_size
        return (f"{self.engine_id} on {self.device}{f' x TP{tp}' if tp > 1 else ''}: "
                f"{self.allocator.num_blocks} KV blocks of {self.config.block_size} tokens")

    # -- requests -----------------------------------------------------------------------

    def add_request(self, req: Request) -> list[RequestOutput]:
        self.requests[req.request_id] = req
        self.detok[req.request_id] = Detokenizer(self.tokenizer, req.params.stop)
        outputs: list[RequestOutput] = []
        if self.connector is not None:
            first = self.connector.on_add(req)
            if first is not None:  # the prefill's first token: emit it before any pull
                token, logprob, top = first
                outputs.append(self._append(req, token, logprob, time.monotonic(), top))
        if not req.finished:
            self.scheduler.add(req)
        return outputs

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, "abort")
        self._update_gauges()  # no step may follow: an idle engine must not show it running
        return self._output(req, [], [])

    def fail_request(self, req: Request, error: str) -> RequestOutput:
        req.error = error
        self._finish(req, "error")
        self._update_gauges()
        return self._output(req, [], [])

    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if self.connector is not None:
            outputs += self.connector.poll()
            # Pulls start before the schedule: one that lands at once joins this step.
            outputs += self._admitted(self.scheduler.admit_loads())
        sched = self.scheduler.schedule()
        outputs += self._admitted(sched)
        self.last_step_prefilled = False
        if sched.items:
            outputs += self._run(sched.items)
        self.last_step_computed = bool(sched.items)
        self._update_gauges()
        return outputs

    def _admitted(self, sched: Schedule) -> list[RequestOutput]:
        """Count what a schedule did; start the pulls of the requests it admitted."""
        self.metrics.preemptions.inc(len(sched.preempted))
        self.metrics.prefix_queries.inc(sched.cache_queries)
        self.metrics.prefix_hits.inc(sched.cache_hits)
        return self.connector.start_load(sched.to_load) if sched.to_load else []

    def _run(self, items: list[tuple[Request, int]]) -> list[RequestOutput]:
        prompt = sum(min(n, req.num_prompt_tokens - req.num_computed_tokens)
                     for req, n in items if req.num_computed_tokens < req.num_prompt_tokens)
        self.metrics.prompt_computed.inc(prompt)
        self.last_step_prefilled = prompt > 0
        sampled, tokens, logprobs, tops = self.runner.run(items)
        for req, n in items:
            req.num_computed_tokens += n
            self.scheduler.cache_computed(req)
        now = time.monotonic()
        return [self._append(r, t, lp, now, top) for r, t, lp, top in
                zip(sampled, tokens, logprobs, tops, strict=True)]

    def _append(self, req: Request, token: int, logprob: float, now: float,
                top: TopLogprobs | None = None) -> RequestOutput:
        req.token_ids.append(token)
        req.output_logprobs.append(logprob)
        if req.params.top_logprobs:
            req.output_top_logprobs.append(top or [])
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.ttft.observe(now - req.arrival_time)
        else:
            self.metrics.itl.observe(now - req.last_token_time)
        req.last_token_time = now
        self.metrics.generation_tokens.inc()
        stopped = self.detok[req.request_id].add(token)
        reason = self._finish_reason(req, token, stopped)
        if reason is not None:
            self._finish(req, reason)
        return self._output(req, [token], [logprob], req.output_top_logprobs[-1:])

    def _finish_reason(self, req: Request, token: int, stopped: bool) -> str | None:
        p = req.params
        if stopped or token in p.stop_token_ids or (
                not p.ignore_eos and token in self.tokenizer.eos_token_ids):
            return "stop"
        if req.num_output_tokens >= p.max_tokens or \
                len(req.token_ids) >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        """End a request: leave the queues, free (or hand over) its blocks."""
        req.finish_reason = reason
        was_loading = req.status is Status.WAITING_FOR_REMOTE_KV
        req.status = Status.FINISHED
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        self.metrics.prompt_tokens.inc(req.num_prompt_tokens)
        if self.connector is not None and self.connector.on_finish(req, was_loading):
            return  # the connector holds the blocks (lease, or a pull still writing them)
        self.free_blocks(req)

    def free_blocks(self, req: Request) -> None:
        self.allocator.free(req.block_ids)
        req.block_ids = []

    def _output(self, req: Request, tokens: list[int], logprobs: list[float],
                top: list[TopLogprobs] | None = None) -> RequestOutput:
        finished = req.finish_reason is not None
        detok = self.detok[req.request_id]
        if finished:
            self.detok.pop(req.request_id, None)
        return RequestOutput(
            req.request_id, tokens, logprobs, detok.take(final=finished),
            req.num_prompt_tokens, req.num_output_tokens, req.finish_reason, req.error,
            req.response_kv_params if finished else None, top or [])

    def _update_gauges(self) -> None:
        m, s = self.metrics, self.scheduler
        m.running.set(len(s.running))
        m.waiting.set(len(s.waiting) + len(s.loading))
        m.blocks_free.set(self.allocator.num_free)
