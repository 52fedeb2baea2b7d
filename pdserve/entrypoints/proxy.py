"""`pdserve proxy`: sends each request to a prefill (max_tokens=1, do_remote_decode), then
to a decode with the kv_transfer_params the prefill returned; streams the decode's answer.
Short prompts, or all prompts while the prefill tier is backed up, may go straight to a
decode, which then prefills them itself.

Speaks vLLM's P/D HTTP protocol, so it can front vLLM instances as well as pdserve."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Coroutine
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.entrypoints.protocol import MAX_N, error_body, require_api_key
from pdserve.entrypoints.proxy_metrics import ProxyMetrics, outcome
from pdserve.entrypoints.routing import (
    Backend,
    Disaggregation,
    Pool,
    PromptTokens,
    add_routing_args,
    check_routing_args,
    poll_queues,
    prefix_key,
)
from pdserve.entrypoints.streams import choice_body, merged_events, sum_usage

log = logging.getLogger("pdserve.proxy")
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")


class BackendDown(Exception):
    pass


def request_log(request_id: str) -> logging.LoggerAdapter:
    """The proxy's logger with every line prefixed by the request's id."""
    return _RequestLog(log, {"request_id": request_id})


class _RequestLog(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"request {self.extra['request_id']}: {msg}", kwargs


@dataclass(slots=True)
class Sent:
    """A backend's answer being read; finish() once it has been read or dropped."""
    backend: Backend
    pool: Pool
    resp: httpx.Response
    start: float
    metrics: ProxyMetrics
    local: bool  # a plain request to a decode, which prefills it (until prefilled())

    def prefilled(self) -> None:
        """Its first token is back (or it ended without one)."""
        if self.local:
            self.local = False
            self.backend.local_prefills -= 1

    def finish(self) -> None:
        self.prefilled()
        self.backend.outstanding -= 1
        labels = (self.backend.url, self.pool.name)
        self.metrics.backend_seconds.labels(*labels).observe(time.monotonic() - self.start)
        self.metrics.backend_requests.labels(*labels, str(self.resp.status_code)).inc()


@dataclass(slots=True)
class Proxy:
    prefill: Pool
    decode: Pool
    client: httpx.AsyncClient
    api_key: str | None = None
    backend_key: str | None = None
    disagg: Disaggregation = field(default_factory=Disaggregation)
    prompt_tokens: PromptTokens | None = None  # loaded only when routing needs counts
    prefix_tokens: int = 64  # the prefix policy's key: this many leading prompt tokens
    metrics: ProxyMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ProxyMetrics([self.prefill, self.decode])

    def headers(self, request_id: str) -> dict[str, str]:
        h = {"X-Request-Id": request_id}
        if self.backend_key:
            h["Authorization"] = f"Bearer {self.backend_key}"
        return h

    async def post(self, pool: Pool, path: str, body: dict, request_id: str,
                   stream: bool, key: bytes | None = None, local: bool = False) -> Sent:
        """POST to the first backend of `pool` that answers; BackendDown if none does.
        `local`: a plain request to a decode, counted in its local_prefills from now."""
        tried = []
        # Not httpx's json=: it refuses NaN and lone surrogates, which clients may send
        # (json.loads took them); the backend judges the body, not the proxy.
        content = json.dumps(body, separators=(",", ":"))
        headers = {**self.headers(request_id), "Content-Type": "application/json"}
        backends, fell_back = pool.order(key)
        if fell_back:
            self.metrics.prefix_fallbacks.labels(pool.name).inc()
        for b in backends:
            req = self.client.build_request("POST", b.url + path, content=content,
                                            headers=headers)
            b.outstanding += 1
            b.local_prefills += local
            start = time.monotonic()
            try:
                resp = await self.client.send(req, stream=stream)
                # A 503 (draining, or shedding load) says: not here, now. The next backend
                # may take it, unless the body names a prefill's KV: the refusing decode
                # has told that prefill to free it (_exchange starts over instead).
                b.mark(reachable=resp.status_code != 503)
                if resp.status_code != 503 or b is backends[-1] or _pulls_kv(body):
                    return Sent(b, pool, resp, start, self.metrics, local)
                await resp.aclose()
                b.unsent(local)
                self.metrics.retries.labels(b.url, pool.name).inc()
                tried.append(f"{b.url} (503)")
                request_log(request_id).warning("%s backend %s answered 503; trying the next",
                                                pool.name, b.url)
            except asyncio.CancelledError:  # our client went away
                b.unsent(local)
                raise
            except httpx.TransportError as e:
                b.unsent(local)
                b.mark(reachable=False)
                self.metrics.retries.labels(b.url, pool.name).inc()
                tried.append(f"{b.url} ({type(e).__name__})")
                request_log(request_id).warning("%s backend %s unreachable: %s", pool.name,
                                                b.url, e)
        raise BackendDown(f"no {pool.name} backend is reachable: {', '.join(tried)}")


def build_app(proxy: Proxy) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        poll = proxy.disagg.max_prefill_queue is not None
        task = asyncio.create_task(poll_queues(proxy.client, proxy.prefill)) if poll else None
        yield
        if task is not None:
            task.cancel()

    app = FastAPI(title="pdserve proxy", lifespan=lifespan)

    require_api_key(app, proxy.api_key)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while every tier has a live backend (status "degraded" if some are down)."""
        tiers = {pool.name: {b.url: await _check(proxy.client, b.url) for b in pool.backends}
                 for pool in (proxy.prefill, proxy.decode)}
        usable = all(any(t.values()) for t in tiers.values())
        whole = all(all(t.values()) for t in tiers.values())
        return JSONResponse({
            "status": "ok" if whole else "degraded" if usable else "down",
            "backends": {u: "ok" if up else "down" for t in tiers.values() for u, up in t.items()},
        }, status_code=200 if usable else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        for b in proxy.decode.order()[0]:
            try:
                r = await proxy.client.get(b.url + "/v1/models", headers=proxy.headers("models"))
                return Response(r.content, r.status_code, media_type="application/json")
            except httpx.TransportError:
                continue
        return _error(503, "no decode backend is reachable")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(proxy, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _handle(proxy, request, "/v1/chat/completions")

    return app


async def _handle(proxy: Proxy, request: Request, path: str) -> Response:
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    if _REQUEST_ID.fullmatch(request_id):
        response = await _respond(proxy, request, path, request_id)
    else:  # it goes into backends' headers and everyone's logs
        request_id = uuid.uuid4().hex
        response = _refuse(request_id, "X-Request-Id must be 1 to 256 printable ASCII "
                                       "characters")
    response.headers["X-Request-Id"] = request_id
    proxy.metrics.requests.labels(path, outcome(response.status_code)).inc()
    return response


async def _respond(proxy: Proxy, request: Request, path: str, request_id: str) -> Response:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _refuse(request_id, f"request body is not valid JSON: {e}")
    except RecursionError:
        return _refuse(request_id, "request body is nested too deeply")
    if not isinstance(body, dict):
        return _refuse(request_id, "request body must be a JSON object")
    stream = bool(body.get("stream"))
    exchange = (_fan_out if _fans_out(body) else _exchange)(proxy, path, body, request_id,
                                                           stream)
    # A streamed answer notices a gone client when a write fails; a plain one must watch.
    return await (exchange if stream else _unless_gone(request, exchange))


def _refuse(request_id: str, message: str) -> JSONResponse:
    request_log(request_id).info("refused: %s", message)
    return _error(400, message)


def _pulls_kv(body: dict) -> bool:
    return bool((body.get("kv_transfer_params") or {}).get("do_remote_prefill"))


async def _exchange(proxy: Proxy, path: str, body: dict, request_id: str,
                    stream: bool) -> Response:
    """One request through the tiers; once more if it got a 503 where another decode could
    serve it (a draining decode refuses a prefilled request and is then tried last)."""
    response = await _through_tiers(proxy, path, body, request_id, stream)
    if response.status_code == 503 and len(proxy.decode.backends) > 1:
        request_log(request_id).info("answered 503; once more, on other backends")
        response = await _through_tiers(proxy, path, body, request_id, stream)
    return response


async def _through_tiers(proxy: Proxy, path: str, body: dict, request_id: str,
                         stream: bool) -> Response:
    """One request through the tiers: prefill then decode, or a decode alone."""
    rlog = request_log(request_id)
    tokens = proxy.prompt_tokens(path, body) if proxy.prompt_tokens else None
    key = prefix_key(tokens, proxy.prefix_tokens)
    reason = proxy.disagg.local_reason(None if tokens is None else len(tokens), proxy.prefill,
                                       proxy.decode)
    try:
        if reason is None:
            try:
                params, error, via = await _prefill(proxy, path, body, request_id, key)
            except BackendDown as e:
                if proxy.disagg.max_prefill_queue is None:  # no overflow to the decodes
                    raise
                rlog.warning("%s", e)
                reason = "prefill_down"
        if reason is not None:  # a plain request: the decode prefills it, as a monolith
            proxy.metrics.routes.labels("local", reason).inc()
            body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
            return await _decode(proxy, path, body, request_id, stream, key,
                                 f"local prefill ({reason})", local=True)
        proxy.metrics.routes.labels("remote", "disaggregated").inc()
        if error is not None:
            rlog.info("prefill %s answered %d", via, error.status_code)
            return error
        decode_body = {**body, "kv_transfer_params": params}
        return await _decode(proxy, path, decode_body, request_id, stream, key,
                             f"prefill {via}")
    except BackendDown as e:
        rlog.warning("%s", e)
        return _error(503, str(e), "service_unavailable")


def _fans_out(body: dict) -> bool:
    n = body.get("n")
    return type(n) is int and 1 < n <= MAX_N  # anything else is the backends' to judge


async def _fan_out(proxy: Proxy, path: str, body: dict, request_id: str,
                   stream: bool) -> Response:
    """n > 1 choices as n prefill -> decode exchanges of one choice each (a prefill hands
    over one request's KV), merged into one answer with the choices re-indexed."""
    answers = await asyncio.gather(*(
        _exchange(proxy, path, choice_body(body, i), request_id, stream)
        for i in range(body["n"])))
    if (bad := next((a for a in answers if a.status_code != 200), None)) is not None:
        for a in answers:
            if isinstance(a, StreamingResponse):
                await a.body_iterator.aclose()
        return bad
    headers = {"X-Request-Id": request_id}
    if stream:
        return StreamingResponse(merged_events(answers), media_type="text/event-stream",
                                 headers=headers)
    parts = [json.loads(a.body) for a in answers]
    choices = [{**c, "index": i} for i, part in enumerate(parts) for c in part["choices"]]
    return JSONResponse({**parts[0], "choices": choices,
                         "usage": sum_usage([part["usage"] for part in parts])},
                        headers=headers)


async def _unless_gone(request: Request, exchange: Coroutine[Any, Any, Response]) -> Response:
    """Run `exchange`, cancelling it once our client has gone: that closes the backend
    connection, which aborts the backend's request instead of generating for nobody."""
    task = asyncio.ensure_future(exchange)
    while not (await asyncio.wait({task}, timeout=0.25))[0]:
        if await request.is_disconnected():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)  # nobody reads it
    return task.result()


async def _prefill(proxy: Proxy, path: str, body: dict, request_id: str, key: bytes | None
                   ) -> tuple[dict | None, Response | None, str]:
    """Run the prompt on a prefill; returns its kv_transfer_params or an error to relay,
    and the prefill's URL."""
    pbody = {**body, "max_tokens": 1, "stream": False,
             "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                    "remote_engine_id": None, "remote_block_ids": None,
                                    "remote_host": None, "remote_port": None}}
    pbody.pop("stream_options", None)
    if "max_completion_tokens" in pbody:
        pbody["max_completion_tokens"] = 1
    sent = await proxy.post(proxy.prefill, path, pbody, request_id, stream=False, key=key)
    sent.finish()
    resp = sent.resp
    if resp.status_code != 200:
        error = Response(resp.content, resp.status_code, media_type="application/json")
        return None, error, sent.backend.url
    return resp.json().get("kv_transfer_params"), None, sent.backend.url


async def _decode(proxy: Proxy, path: str, body: dict, request_id: str, stream: bool,
                  key: bytes | None, via: str, local: bool = False) -> Response:
    """Send `body` to a decode and relay its answer; `local`: a plain request, which the
    decode prefills itself (counted in its local_prefills until its first token is back)."""
    sent = await proxy.post(proxy.decode, path, body, request_id, stream=True, key=key,
                            local=local)
    resp = sent.resp
    request_log(request_id).info("%s -> decode %s answered %d", via, sent.backend.url,
                                 resp.status_code)
    if not stream or resp.status_code != 200:
        try:
            content = await resp.aread()
        finally:
            sent.finish()
            await resp.aclose()
        return Response(content, resp.status_code, media_type="application/json")

    async def relay():
        try:
            async for chunk in resp.aiter_raw():
                sent.prefilled()
                yield chunk
        finally:  # also when the client goes away: closing aborts the decode's request
            sent.finish()
            await resp.aclose()

    return StreamingResponse(relay(), media_type="text/event-stream")


async def _check(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(url + "/health", timeout=2)).status_code == 200
    except httpx.TransportError:
        return False


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(error_body(message, status, kind), status_code=status)


def add_parser(sub) -> None:
    p = sub.add_parser("proxy", help="route requests prefill -> decode")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_routing_args(p)
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    p.add_argument("--backend-api-key", default=None, help="default: --api-key")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pdserve.config import ConfigError
    from pdserve.model.loader import ModelLoadError

    if problem := check_routing_args(args):
        raise ConfigError(problem)

    def pool(name: str, urls: list[str]) -> Pool:
        return Pool(name, [Backend(u.rstrip("/")) for u in urls], args.policy,
                    args.prefix_max_imbalance)

    try:  # token counts only where routing needs them: the tokenizer costs a torch import
        counted = args.policy == "prefix" or args.local_prefill_below is not None
        prompt_tokens = PromptTokens(args.tokenizer) if counted else None
    except ModelLoadError as e:
        raise ConfigError(f"cannot load the tokenizer: {e}") from None
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=limits)
    proxy = Proxy(pool("prefill", args.prefill), pool("decode", args.decode), client,
                  args.api_key, args.backend_api_key or args.api_key,
                  Disaggregation(args.local_prefill_below, args.max_prefill_queue),
                  prompt_tokens, args.prefix_tokens)
    log.info("proxy on http://%s:%d: prefill %s, decode %s, policy %s, %s", args.host,
             args.port, " ".join(args.prefill), " ".join(args.decode), args.policy, proxy.disagg)
    uvicorn.run(build_app(proxy), host=args.host, port=args.port, log_level="warning")
    return 0

