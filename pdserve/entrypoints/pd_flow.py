"""A request's way through `pdserve proxy`'s tiers: to a prefill (max_tokens=1,
do_remote_decode), then to a decode with the kv_transfer_params the prefill returned,
whose answer is relayed. Short prompts, or all prompts while the prefill tier is backed
up, may go straight to a decode, which then prefills them itself; n > 1 choices go as n
such exchanges. Proxy.post sends to a tier, moving on past backends that are down.

Speaks vLLM's P/D HTTP protocol, so it can front vLLM instances as well as pdserve."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.entrypoints.protocol import MAX_N, error_body, error_response, sse_event
from pdserve.entrypoints.proxy_metrics import ProxyMetrics
from pdserve.entrypoints.routing import (
    Backend,
    Disaggregation,
    Pool,
    PromptTokens,
    Residency,
    prefix_key,
)
from pdserve.entrypoints.streams import choice_body, merged_events, sum_usage

log = logging.getLogger("pdserve.proxy")


# Answers from a prefill that say it failed or is going away: another prefill may serve.
# (A decode's 503 is retried too; its other 5xx are relayed: it may have pulled the KV.)
PREFILL_RETRY_STATUSES = frozenset({500, 502, 503})
# Backends a request may reach and lose (a 5xx, or a connection dropped mid-request) before
# the proxy gives up on the tier: the first and one retry. One that refuses the connection
# costs nothing and does not count.
MAX_LOST_SENDS = 2


class BackendDown(Exception):
    """No backend of a tier took the request."""


class BackendDied(Exception):
    """A decode took a request naming a prefill's KV and failed before answering: the KV
    may be gone (read, then freed by the prefill), so no other decode may read it."""


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
    residency: Residency = field(default_factory=Residency)  # decodes' prompts (if counted)
    metrics: ProxyMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ProxyMetrics([self.prefill, self.decode])

    def headers(self, request_id: str) -> dict[str, str]:
        h = {"X-Request-Id": request_id}
        if self.backend_key:
            h["Authorization"] = f"Bearer {self.backend_key}"
        return h

    async def post(self, pool: Pool, path: str, body: dict, request_id: str,
                   stream: bool, key: bytes | None = None, local: bool = False,
                   prefer: Backend | None = None) -> Sent:
        """POST to the first backend of `pool` that answers; BackendDown if none does.
        `local`: a plain request to a decode, counted in its local_prefills from now;
        `prefer`: the backend to try first while load allows (Pool.order)."""
        tried: list[str] = []
        # Not httpx's json=: it refuses NaN and lone surrogates, which clients may send
        # (json.loads took them); the backend judges the body, not the proxy.
        content = json.dumps(body, separators=(",", ":"))
        headers = {**self.headers(request_id), "Content-Type": "application/json"}
        backends, fell_back = pool.order(key, prefer)
        if not backends:
            raise BackendDown(f"no {pool.name} backend is known (its names resolve to no "
                              "address)")
        # A prefill tier that cannot answer hands the prompt to a decode (_through_tiers);
        # a decode tier's last answer is relayed, whatever it is.
        retry = PREFILL_RETRY_STATUSES if pool is self.prefill else frozenset({503})
        last = None if pool is self.prefill else backends[-1]
        if fell_back:
            self.metrics.prefix_fallbacks.labels(pool.name).inc()
        lost = 0
        for b in backends:
            if lost == MAX_LOST_SENDS:
                break
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
                if resp.status_code not in retry or b is last or _pulls_kv(body):
                    return Sent(b, pool, resp, start, self.metrics, local)
                lost += resp.status_code != 503
                await resp.aclose()
                b.unsent(local)
                why = f"answered {resp.status_code}"
            except asyncio.CancelledError:  # our client went away
                b.unsent(local)
                raise
            except httpx.TransportError as e:
                b.unsent(local)
                b.mark(reachable=False)
                why = f"unreachable: {type(e).__name__}"
                # No connection, no request: a pod that just left (its address no longer
                # answers) times out connecting; anything later, it took the request, then died.
                if not isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
                    why = f"lost the request: {type(e).__name__}"
                    lost += 1
                    if _pulls_kv(body):
                        raise BackendDied(f"{pool.name} backend {b.url} {why}") from e
            self.metrics.retries.labels(b.url, pool.name).inc()
            tried.append(f"{b.url} ({why})")
            request_log(request_id).warning("%s backend %s %s; trying the next", pool.name,
                                            b.url, why)
        raise BackendDown(f"no {pool.name} backend took the request: {', '.join(tried)}")


async def answer(proxy: Proxy, path: str, body: dict, request_id: str,
                 stream: bool) -> Response:
    """The tiers' answer to a client's request (a JSON object)."""
    exchange = _fan_out if _fans_out(body) else _exchange
    return await exchange(proxy, path, body, request_id, stream)


def _pulls_kv(body: dict) -> bool:
    return bool((body.get("kv_transfer_params") or {}).get("do_remote_prefill"))


async def _exchange(proxy: Proxy, path: str, body: dict, request_id: str,
                    stream: bool) -> Response:
    """One request through the tiers; once more, from its prefill, if it got a 503 or a 502
    where another decode could serve it: a draining decode refuses a prefilled request, a
    dying one loses it (either is then tried last)."""
    response = await _through_tiers(proxy, path, body, request_id, stream)
    if response.status_code in (502, 503) and len(proxy.decode.backends) > 1:
        request_log(request_id).info("answered 503; once more, on other backends")
        response = await _through_tiers(proxy, path, body, request_id, stream)
    return response


async def _through_tiers(proxy: Proxy, path: str, body: dict, request_id: str,
                         stream: bool) -> Response:
    """One request through the tiers: prefill then decode, or a decode alone."""
    rlog = request_log(request_id)
    tokens = proxy.prompt_tokens(path, body) if proxy.prompt_tokens else None
    key = prefix_key(tokens, proxy.prefix_tokens)
    # A decode holding the prompt's start (a conversation's earlier turns) computes only
    # the rest: that is what counts against --local-prefill-below.
    blocks = Residency.blocks(tokens) if tokens else []
    home, held = proxy.residency.find(blocks, proxy.decode)
    reason = proxy.disagg.local_reason(None if tokens is None else len(tokens) - held,
                                       proxy.prefill, proxy.decode)
    if reason == "short_prompt" and held:
        reason = "cached_prefix"
    route = Route(key, home, blocks)
    try:
        if reason is None:
            try:
                params, error, via = await _prefill(proxy, path, body, request_id, key)
            except BackendDown as e:  # the decode prefills it: slower, but answered
                rlog.warning("%s", e)
                reason = "prefill_down"
        if reason is not None:  # a plain request: the decode prefills it, as a monolith
            proxy.metrics.routes.labels("local", reason).inc()
            body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
            return await _decode(proxy, path, body, request_id, stream, route,
                                 f"local prefill ({reason})", local=True)
        proxy.metrics.routes.labels("remote", "disaggregated").inc()
        if error is not None:
            rlog.info("prefill %s answered %d", via, error.status_code)
            return error
        decode_body = {**body, "kv_transfer_params": params}
        return await _decode(proxy, path, decode_body, request_id, stream, route,
                             f"prefill {via}")
    except BackendDown as e:
        rlog.warning("%s", e)
        return error_response(503, str(e), "service_unavailable")
    except BackendDied as e:
        rlog.warning("%s", e)
        return error_response(502, str(e), "service_unavailable")


@dataclass(slots=True)
class Route:
    """What routing knows of a prompt."""
    key: bytes | None  # the prefix policy's key
    home: Backend | None  # the decode holding the longest prefix of it
    blocks: list[bytes]  # its full blocks' hashes (Residency.blocks), if counted


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
                  route: Route, via: str, local: bool = False) -> Response:
    """Send `body` to a decode and relay its answer; `local`: a plain request, which the
    decode prefills itself (counted in its local_prefills until its first token is back)."""
    sent = await proxy.post(proxy.decode, path, body, request_id, stream=True, key=route.key,
                            local=local, prefer=route.home)
    resp = sent.resp
    if route.blocks and resp.status_code == 200:
        proxy.residency.sent(sent.backend, route.blocks)
    request_log(request_id).info("%s -> decode %s answered %d", via, sent.backend.url,
                                 resp.status_code)
    if not stream or resp.status_code != 200:
        try:
            content = await resp.aread()
        except httpx.TransportError as e:
            raise BackendDied(f"decode backend {sent.backend.url} lost the request: "
                              f"{type(e).__name__}") from e
        finally:
            sent.finish()
            await resp.aclose()
        return Response(content, resp.status_code, media_type="application/json")

    async def relay():
        try:
            async for chunk in resp.aiter_raw():
                sent.prefilled()
                yield chunk
        except httpx.TransportError as e:  # the decode died mid-stream: say so, then end
            why = f"decode backend {sent.backend.url} failed mid-stream: {type(e).__name__}"
            request_log(request_id).warning("%s", why)
            sent.backend.mark(reachable=False)
            yield sse_event(error_body(why, 502, "service_unavailable"))
            yield "data: [DONE]\n\n"
        finally:  # also when the client goes away: closing aborts the decode's request
            sent.finish()
            await resp.aclose()

    return StreamingResponse(relay(), media_type="text/event-stream")
