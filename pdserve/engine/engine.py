"""The engine: model, paged KV cache, scheduler and sampler driven one step at a time, and
the KV connector asked and told through its contract (kv_transfer/interface.py).

Single-threaded by design: only the step-loop thread calls into it. engine/build.py
assembles it from its parts."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from pdserve.config import EngineConfig
from pdserve.engine.block_allocator import BlockAllocator
from pdserve.engine.detokenizer import Detokenizer
from pdserve.engine.metrics import EngineMetrics
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request, RequestOutput, Status, TopLogprobs
from pdserve.engine.scheduler import Schedule, Scheduler
from pdserve.engine.structured import GrammarError, Grammars
from pdserve.kv_transfer.interface import KVConnector, KVConnectorOutput, Load
from pdserve.kv_transfer.params import FirstToken
from pdserve.model.tokenizer import Tokenizer

log = logging.getLogger("pdserve.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer: Tokenizer,
                 connector: KVConnector | None = None,
                 registry: CollectorRegistry | None = None, engine_id: str = "local",
                 dp_rank: int = 0, on_close: Callable[[], None] | None = None) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.connector = connector
        self.engine_id, self.dp_rank = engine_id, dp_rank
        self._on_close = on_close  # stops what the builder started (tensor-parallel ranks)
        self.allocator = BlockAllocator(runner.num_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.allocator)
        self.metrics = EngineMetrics(registry or CollectorRegistry(), engine_id)
        self.metrics.blocks_total.set(self.allocator.num_blocks)
        self.requests: dict[str, Request] = {}
        self.detok: dict[str, Detokenizer] = {}
        self.grammars = Grammars(tokenizer, runner.model.config.vocab_size)
        self.last_step_computed = False  # did the last step run the model?
        self.last_step_prefilled = False  # ... on prompt tokens (not only decodes)?
        self._update_gauges()

    def close(self) -> None:
        """Close the connector and stop the tensor-parallel workers (the step loop must be
        stopped first)."""
        if self.connector is not None:
            self.connector.close()
        if self._on_close is not None:
            self._on_close()

    def describe(self) -> str:
        tp = self.config.tensor_parallel_size
        return (f"{self.engine_id} on {self.runner.cache.tensor.device}"
                f"{f' x TP{tp}' if tp > 1 else ''}: {self.allocator.num_blocks} KV blocks of "
                f"{self.config.block_size} tokens")

    def kv_info(self) -> list[dict]:
        """Where decodes reach each rank of this engine (its identity alone without KV
        transfer)."""
        if self.connector is None:
            return [{"engine_id": self.engine_id, "dp_rank": self.dp_rank, "tp_rank": 0}]
        return self.connector.info()

    def set_checkpoint(self, checkpoint: Callable[[], None]) -> None:
        """Call `checkpoint` between the model's layers (core loans: model/llama.py)."""
        self.runner.model.checkpoint = checkpoint

    # -- requests -----------------------------------------------------------------------

    def add_request(self, req: Request) -> list[RequestOutput]:
        if req.params.grammar is not None:
            try:  # the API server compiled it already: found in the cache (or this rank's)
                req.matcher = self.grammars.matcher(req.params.grammar)
            except GrammarError as e:
                req.finish_reason, req.error = "error", f"invalid structured output: {e}"
                return [RequestOutput(req.request_id, [], [], "", req.num_prompt_tokens, 0,
                                      req.finish_reason, req.error)]
        self.requests[req.request_id] = req
        self.detok[req.request_id] = Detokenizer(self.tokenizer, req.params.stop)
        outputs: list[RequestOutput] = []
        remote = self.connector.on_new_request(
            req.request_id, req.kv_transfer_params, req.num_prompt_tokens) \
            if self.connector is not None else None
        if remote is not None:
            first = remote.first_token
            if first is not None and first.prompt_logprobs is not None:
                req.prompt_logprobs = first.prompt_logprobs
            # A prefill that sent no prompt logprobs asked for (vLLM's) leaves them to be
            # computed here: from the prompt, not from pulled KV.
            req.load_remote = remote.load and not req.needs_prompt_logprobs
            if first is not None:  # emitted before any pull
                outputs.append(self._append(req, first.token_id, first.logprob,
                                            time.monotonic(), first.top_logprobs))
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

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request with `error` (the step failed)."""
        return [self._fail(r, error) for r in list(self.requests.values())]

    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    # -- the connector's side of the loop -----------------------------------------------

    def kv_busy(self) -> bool:
        """Transfers only polling advances are under way."""
        return self.connector is not None and self.connector.busy()

    def idle_timeout(self, default: float) -> float:
        """How long the loop may sleep with nothing to compute."""
        return default if self.connector is None else min(default,
                                                          self.connector.poll_interval())

    def end_leases(self) -> None:
        if self.connector is not None:
            self.connector.end_leases()

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if self.connector is not None:
            outputs += self._apply(self.connector.poll())
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
        if not sched.to_load:
            return []
        return self._apply(self.connector.start_loads(
            [Load(r.request_id, r.block_ids, r.num_cached_tokens) for r in sched.to_load]))

    def _apply(self, out: KVConnectorOutput) -> list[RequestOutput]:
        """Act on what the connector reports."""
        self.allocator.free(out.free_blocks)
        for rid in out.loaded:
            if (req := self.requests.get(rid)) is not None:
                req.shareable = rid not in out.windowed
                # Without a first token from the prefill, the last prompt token runs here.
                self.scheduler.loaded(req, ok=True, recompute_last=req.num_output_tokens == 0)
        for rid in out.recompute:
            if (req := self.requests.get(rid)) is not None:
                if req.status is Status.WAITING_FOR_REMOTE_KV:
                    self.scheduler.loaded(req, ok=False)
                req.load_remote = False
        return [self._fail(req, why) for rid, why in out.failed.items()
                if (req := self.requests.get(rid)) is not None]

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
        reason = self._grammar_reason(req, token) or self._finish_reason(req, token, stopped)
        if reason is not None:
            self._finish(req, reason)
        out = self._output(req, [token], [logprob], req.output_top_logprobs[-1:])
        if req.num_output_tokens == 1 and req.params.prompt_logprobs is not None:
            out.prompt_logprobs = req.prompt_logprobs
        return out

    def _grammar_reason(self, req: Request, token: int) -> str | None:
        """Advance the request's grammar with its new token (a remote prefill's first token
        too, so a decode's matcher starts where the prefill's stopped): "stop" once the
        grammar is complete, "error" for a token it refuses (a prefill that did not apply
        the constraint)."""
        if req.matcher is None:
            return None
        if not req.matcher.accept_token(token):
            req.error = f"token {token} does not follow the request's structured output"
            return "error"
        return "stop" if req.matcher.is_terminated() else None

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
        """End a request: leave the queues, free its blocks (or leave them to the
        connector, which gives them back later)."""
        req.finish_reason = reason
        req.status = Status.FINISHED
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        self.metrics.prompt_tokens.inc(req.num_prompt_tokens)
        if self.connector is not None:
            first = FirstToken(req.output_token_ids[0], req.output_logprobs[0],
                               (req.output_top_logprobs or [[]])[0],
                               req.prompt_logprobs if req.params.prompt_logprobs is not None
                               else None) \
                if reason in ("stop", "length") and req.num_output_tokens else None
            kept, req.response_kv_params = self.connector.request_finished(
                req.request_id, req.kv_transfer_params, req.block_ids, first)
            if kept:
                return
        self.allocator.free(req.block_ids)
        req.block_ids = []

    def _fail(self, req: Request, error: str) -> RequestOutput:
        req.error = error
        self._finish(req, "error")
        self._update_gauges()
        return self._output(req, [], [])

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
