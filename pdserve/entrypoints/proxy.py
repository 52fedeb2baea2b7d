"""`pdserve proxy`'s HTTP app: its endpoints, each client request's id, refusals of
bodies that are not JSON objects, and clients that go away; the way through the tiers is
pd_flow.py, the command line proxy_cli.py."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Coroutine
from contextlib import asynccontextmanager, suppress
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.entrypoints.body_limit import DEFAULT_MAX_BYTES, BodyLimit
from pdserve.entrypoints.disconnect import disconnected
from pdserve.entrypoints.discovery import Discovery
from pdserve.entrypoints.pd_flow import Proxy, answer, request_log
from pdserve.entrypoints.protocol import error_response, require_api_key, valid_request_id
from pdserve.entrypoints.proxy_metrics import outcome
from pdserve.entrypoints.routing import Pool, poll_queues


def build_app(proxy: Proxy, max_request_bytes: int = DEFAULT_MAX_BYTES,
              discovery: Discovery | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        tasks = []
        if discovery is not None:
            await discovery.refresh()  # the backends there are before the first request
            tasks.append(asyncio.create_task(discovery.run()))
        if proxy.disagg.max_prefill_queue is not None:
            tasks.append(asyncio.create_task(poll_queues(proxy.client, proxy.prefill)))
        yield
        for task in tasks:
            task.cancel()

    app = FastAPI(title="pdserve proxy", lifespan=lifespan)

    require_api_key(app, proxy.api_key)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)

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
        return await _any_backend(proxy, "GET", "/v1/models", [proxy.decode])

    # Every instance serves the same model: any of them tokenizes.
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _any_backend(proxy, "POST", "/tokenize", [proxy.decode, proxy.prefill],
                                  await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _any_backend(proxy, "POST", "/detokenize", [proxy.decode, proxy.prefill],
                                  await request.body())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(proxy, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _handle(proxy, request, "/v1/chat/completions")

    return app


async def _handle(proxy: Proxy, request: Request, path: str) -> Response:
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    if valid_request_id(request_id):
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
    exchange = answer(proxy, path, body, request_id, stream)
    # A streamed answer notices a gone client when a write fails; a plain one must watch.
    return await (exchange if stream else _unless_gone(request, exchange))


def _refuse(request_id: str, message: str) -> JSONResponse:
    request_log(request_id).info("refused: %s", message)
    return error_response(400, message)


async def _unless_gone(request: Request, exchange: Coroutine[Any, Any, Response]) -> Response:
    """Run `exchange`, cancelling it once our client has gone: that closes the backend
    connection, which aborts the backend's request instead of generating for nobody."""
    task = asyncio.ensure_future(exchange)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)  # nobody reads it


async def _any_backend(proxy: Proxy, method: str, path: str, pools: list[Pool],
                       content: bytes | None = None) -> Response:
    """The answer of the first backend of `pools` that can be reached, relayed as it is."""
    headers = {**proxy.headers(uuid.uuid4().hex), "Content-Type": "application/json"}
    for pool in pools:
        for b in pool.order()[0]:
            try:
                r = await proxy.client.request(method, b.url + path, content=content,
                                               headers=headers)
            except httpx.TransportError:
                continue
            return Response(r.content, r.status_code, media_type="application/json")
    return error_response(503, f"no {' or '.join(p.name for p in pools)} backend is "
                               "reachable")


async def _check(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(url + "/health", timeout=2)).status_code == 200
    except httpx.TransportError:
        return False
