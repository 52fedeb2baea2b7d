"""`pdserve proxy`: sends each request to a prefill (max_tokens=1, do_remote_decode), then
to a decode with the kv_transfer_params the prefill returned; streams the decode's answer.

Speaks vLLM's P/D HTTP protocol, so it can front vLLM instances as well as pdserve."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import uuid
from collections.abc import Coroutine
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.entrypoints.protocol import MAX_N, error_body, require_api_key
from pdserve.entrypoints.streams import merge_streams, sum_usage

log = logging.getLogger("pdserve.proxy")


@dataclass(slots=True)
class Backend:
    url: str
    outstanding: int = 0


@dataclass(slots=True)
class Pool:
    """Backends of one tier and the policy that picks among them."""
    name: str
    backends: list[Backend]
    policy: str = "round_robin"
    _turn: itertools.count = field(default_factory=itertools.count)

    def order(self) -> list[Backend]:
        """Backends in the order to try them: the policy's pick first."""
        n = len(self.backends)
        if self.policy == "least_loaded":
            return sorted(self.backends, key=lambda b: b.outstanding)
        start = next(self._turn) % n
        return self.backends[start:] + self.backends[:start]


class BackendDown(Exception):
    pass


@dataclass(slots=True)
class Proxy:
    prefill: Pool
    decode: Pool
    client: httpx.AsyncClient
    api_key: str | None = None
    backend_key: str | None = None

    def headers(self, request_id: str) -> dict[str, str]:
        h = {"X-Request-Id": request_id}
        if self.backend_key:
            h["Authorization"] = f"Bearer {self.backend_key}"
        return h

    async def post(self, pool: Pool, path: str, body: dict, request_id: str,
                   stream: bool) -> tuple[Backend, httpx.Response]:
        """POST to the first backend of `pool` that answers; BackendDown if none does."""
        tried = []
        # Not httpx's json=: it refuses NaN and lone surrogates, which clients may send
        # (json.loads took them); the backend judges the body, not the proxy.
        content = json.dumps(body, separators=(",", ":"))
        headers = {**self.headers(request_id), "Content-Type": "application/json"}
        for b in pool.order():
            req = self.client.build_request("POST", b.url + path, content=content,
                                            headers=headers)
            try:
                b.outstanding += 1
                resp = await self.client.send(req, stream=stream)
                return b, resp
            except asyncio.CancelledError:  # our client went away
                b.outstanding -= 1
                raise
            except httpx.TransportError as e:
                b.outstanding -= 1
                tried.append(f"{b.url} ({type(e).__name__})")
                log.warning("%s backend %s unreachable: %s", pool.name, b.url, e)
        raise BackendDown(f"no {pool.name} backend is reachable: {', '.join(tried)}")


def build_app(proxy: Proxy) -> FastAPI:
    app = FastAPI(title="pdserve proxy")

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

    @app.get("/v1/models")
    async def models() -> Response:
        for b in proxy.decode.order():
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
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _error(400, f"request body is not valid JSON: {e}")
    except RecursionError:
        return _error(400, "request body is nested too deeply")
    if not isinstance(body, dict):
        return _error(400, "request body must be a JSON object")
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    stream = bool(body.get("stream"))
    exchange = (_fan_out if _fans_out(body) else _exchange)(proxy, path, body, request_id,
                                                           stream)
    # A streamed answer notices a gone client when a write fails; a plain one must watch.
    return await (exchange if stream else _unless_gone(request, exchange))


async def _exchange(proxy: Proxy, path: str, body: dict, request_id: str,
                    stream: bool) -> Response:
    try:
        params, error = await _prefill(proxy, path, body, request_id)
        if error is not None:
            return error
        decode_body = {**body, "kv_transfer_params": params}
        return await _decode(proxy, path, decode_body, request_id, stream)
    except BackendDown as e:
        return _error(503, str(e), "service_unavailable")


def _fans_out(body: dict) -> bool:
    n = body.get("n")
    return type(n) is int and 1 < n <= MAX_N  # anything else is the backends' to judge


async def _fan_out(proxy: Proxy, path: str, body: dict, request_id: str,
                   stream: bool) -> Response:
    """n > 1 choices as n prefill -> decode exchanges of one choice each (a prefill hands
    over one request's KV), merged into one answer with the choices re-indexed."""
    answers = await asyncio.gather(*(
        _exchange(proxy, path, _choice_body(body, i), request_id, stream)
        for i in range(body["n"])))
    if (bad := next((a for a in answers if a.status_code != 200), None)) is not None:
        for a in answers:
            if isinstance(a, StreamingResponse):
                await a.body_iterator.aclose()
        return bad
    headers = {"X-Request-Id": request_id}
    if stream:
        return StreamingResponse(_merged_events(answers), media_type="text/event-stream",
                                 headers=headers)
    parts = [json.loads(a.body) for a in answers]
    choices = [{**c, "index": i} for i, part in enumerate(parts) for c in part["choices"]]
    return JSONResponse({**parts[0], "choices": choices,
                         "usage": sum_usage([part["usage"] for part in parts])},
                        headers=headers)


def _choice_body(body: dict, i: int) -> dict:
    """Choice i alone: n = 1 and, as a server seeds its choice i, seed + i."""
    seed = body.get("seed")
    return {**body, "n": 1, **({"seed": seed + i} if type(seed) is int else {})}


async def _merged_events(answers: list[StreamingResponse]):
    """The choices' SSE streams as one: chunks re-indexed, one usage chunk (if asked) after
    all choices, one [DONE]."""
    async def events(i: int, answer: StreamingResponse):
        buf = b""
        try:
            async for data in answer.body_iterator:
                buf += data if isinstance(data, bytes) else data.encode()
                *complete, buf = buf.split(b"\n\n")
                for event in complete:
                    yield i, event
        finally:  # closes the decode's response: aborts its request if we stop early
            await answer.body_iterator.aclose()

    usages = []
    async for i, event in merge_streams([events(i, a) for i, a in enumerate(answers)]):
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            continue
        chunk = json.loads(event[6:])
        if chunk.get("usage") and not chunk.get("choices"):
            usages.append(chunk)
            continue
        for c in chunk.get("choices") or []:
            c["index"] = i
        yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
    if usages:
        usage = {**usages[0], "usage": sum_usage([u["usage"] for u in usages])}
        yield f"data: {json.dumps(usage, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"


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


async def _prefill(proxy: Proxy, path: str, body: dict, request_id: str
                   ) -> tuple[dict | None, Response | None]:
    """Run the prompt on a prefill; returns its kv_transfer_params, or an error to relay."""
    pbody = {**body, "max_tokens": 1, "stream": False,
             "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                    "remote_engine_id": None, "remote_block_ids": None,
                                    "remote_host": None, "remote_port": None}}
    pbody.pop("stream_options", None)
    if "max_completion_tokens" in pbody:
        pbody["max_completion_tokens"] = 1
    backend, resp = await proxy.post(proxy.prefill, path, pbody, request_id, stream=False)
    backend.outstanding -= 1
    if resp.status_code != 200:
        return None, Response(resp.content, resp.status_code, media_type="application/json")
    return resp.json().get("kv_transfer_params"), None


async def _decode(proxy: Proxy, path: str, body: dict, request_id: str,
                  stream: bool) -> Response:
    backend, resp = await proxy.post(proxy.decode, path, body, request_id, stream=True)
    headers = {"X-Request-Id": request_id}
    if not stream or resp.status_code != 200:
        try:
            content = await resp.aread()
        finally:
            backend.outstanding -= 1
            await resp.aclose()
        return Response(content, resp.status_code, media_type="application/json",
                        headers=headers)

    async def relay():
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:  # also when the client goes away: closing aborts the decode's request
            backend.outstanding -= 1
            await resp.aclose()

    return StreamingResponse(relay(), media_type="text/event-stream", headers=headers)


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
    p.add_argument("--policy", default="round_robin", choices=["round_robin", "least_loaded"])
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    p.add_argument("--backend-api-key", default=None, help="default: --api-key")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    def pool(name: str, urls: list[str]) -> Pool:
        return Pool(name, [Backend(u.rstrip("/")) for u in urls], args.policy)

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=limits)
    proxy = Proxy(pool("prefill", args.prefill), pool("decode", args.decode), client,
                  args.api_key, args.backend_api_key or args.api_key)
    log.info("proxy on http://%s:%d: prefill %s, decode %s, policy %s", args.host, args.port,
             " ".join(args.prefill), " ".join(args.decode), args.policy)
    uvicorn.run(build_app(proxy), host=args.host, port=args.port, log_level="warning")
    return 0

