"""OpenAI-compatible HTTP server in front of one engine."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from pdserve.engine.async_engine import StreamingClient
from pdserve.engine.request import Request as EngineRequest
from pdserve.engine.request import RequestOutput
from pdserve.entrypoints.admission import Admission, Ticket
from pdserve.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _Body,
    error_body,
    require_api_key,
)
from pdserve.model.tokenizer import Tokenizer

log = logging.getLogger("pdserve.api")
# It goes into log lines and response headers: printable ASCII only (as the proxy's rule).
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass(slots=True)
class ServerState:
    engine: StreamingClient  # AsyncEngine, or DPEngine over engine-rank processes
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    validate_kv_params: Callable[[dict[str, Any], int], None] | None = None
    kv_info: Callable[[], list[dict[str, Any]]] | None = None
    api_key: str | None = None
    admission: Admission = field(default_factory=Admission)
    request_timeout: float | None = None  # seconds; a request's own may be shorter
    # Frees a remote prefill's blocks for kv_transfer_params we will not read (blocking).
    release_remote: Callable[[dict[str, Any]], None] | None = None


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="pdserve")
    app.state.pd = state
    app.add_exception_handler(HTTPError, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    require_api_key(app, state.api_key)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.admission.draining:  # load balancers take it out of rotation
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        text = await state.engine.metrics() + generate_latest(state.admission.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
            "max_model_len": state.max_model_len}]}

    @app.get("/v1/kv_transfer/info")
    async def kv_transfer_info() -> dict:
        if state.kv_info is None:
            raise HTTPError(404, "KV transfer is not enabled on this server "
                                 "(start it with --kv-transfer-config)")
        return {"ranks": state.kv_info()}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        try:
            prompt = body.single_prompt()
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        ids = _encode(state, prompt) if isinstance(prompt, str) else prompt
        req = _engine_request(state, body, ids, body.max_tokens or 16,
                              body.logprobs is not None, raw)
        return await _respond(state, req, body, raw, _CompletionFormat(state, req, body))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = state.tokenizer.apply_chat_template(messages)
        except ValueError as e:
            raise HTTPError(400, f"cannot apply the chat template: {e}") from None
        ids = _encode(state, text)
        max_tokens = body.max_completion_tokens or body.max_tokens or \
            max(state.max_model_len - len(ids), 1)
        req = _engine_request(state, body, ids, max_tokens, body.logprobs, raw)
        return await _respond(state, req, body, raw, _ChatFormat(state, req, body))

    return app


def _encode(state: ServerState, text: str) -> list[int]:
    try:  # JSON may carry lone surrogates ("\\ud800"), which no tokenizer takes
        text.encode()
    except UnicodeEncodeError as e:
        raise HTTPError(400, f"the prompt is not valid Unicode: {e.reason} at "
                             f"position {e.start}") from None
    return state.tokenizer.encode(text)


def _engine_request(state: ServerState, body: _Body, ids: list[int], max_tokens: int,
                    logprobs: bool, raw: Request) -> EngineRequest:
    if body.model is not None and body.model != state.model_name:
        raise HTTPError(400, f"The model `{body.model}` does not exist; this server serves "
                             f"`{state.model_name}`.")
    if any(not 0 <= t < state.tokenizer.vocab_size for t in ids):
        raise HTTPError(400, f"prompt token ids must be in [0, {state.tokenizer.vocab_size})")
    if len(ids) + max_tokens > state.max_model_len:
        raise HTTPError(400, f"This model's maximum context length is {state.max_model_len} "
                             f"tokens; you requested {len(ids) + max_tokens} ({len(ids)} in "
                             f"the prompt, {max_tokens} to generate).")
    params = {k: v for k, v in (body.kv_transfer_params or {}).items() if v is not None}
    if params and state.validate_kv_params is not None:
        try:
            state.validate_kv_params(params, len(ids))
        except ValueError as e:
            raise HTTPError(400, f"invalid kv_transfer_params: {e}") from None
    if (given := raw.headers.get("x-request-id")) is not None and \
            not _REQUEST_ID.fullmatch(given):
        raise HTTPError(400, "X-Request-Id must be 1 to 256 printable ASCII characters")
    # The engine's id keeps the client's X-Request-Id (so every log line about the request
    # names it) plus a suffix: one server may see the same id twice (prefill and decode).
    return EngineRequest(f"{request_id(raw)}-{uuid.uuid4().hex[:8]}", ids,
                         body.sampling_params(max_tokens, logprobs), params or None)


def request_id(raw: Request) -> str:
    """The client's X-Request-Id, or one made up for this request (echoed in the answer)."""
    if not hasattr(raw.state, "request_id"):
        given = raw.headers.get("x-request-id", "")
        raw.state.request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
    return raw.state.request_id


async def _respond(state: ServerState, req: EngineRequest, body: _Body, raw: Request,
                   fmt: _Format) -> Response:
    ticket = state.admission.admit()
    if not isinstance(ticket, Ticket):
        log.warning("request %s: refused with %d: %s", req.request_id, *ticket)
        p = req.kv_transfer_params or {}
        if p.get("do_remote_prefill") and state.release_remote is not None:
            # Its engine never sees it, so nothing else would let the prefill go before
            # the lease ends (under overload, when its blocks are needed most).
            asyncio.get_running_loop().run_in_executor(None, state.release_remote, p)
        raise HTTPError(*ticket, "rate_limit_exceeded" if ticket[0] == 429 else
                        "service_unavailable")
    log.info("request %s: %d prompt tokens, max_tokens %d%s", req.request_id,
             req.num_prompt_tokens, req.params.max_tokens, _role(req))
    timeout = min(t for t in (state.request_timeout, body.request_timeout, float("inf"))
                  if t is not None)
    outputs = _run(state, state.engine.generate(req), req, ticket, timeout)
    headers = {"X-Request-Id": request_id(raw)}
    if body.stream:  # Starlette cancels the stream when the client goes
        return StreamingResponse(_sse(fmt, outputs), media_type="text/event-stream",
                                 headers=headers, background=BackgroundTask(ticket.release))
    collect = asyncio.ensure_future(_collect(fmt, outputs))
    gone = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # cancelling the collector closes the stream, which aborts the request
        for task in (gone, collect):
            task.cancel()
        await asyncio.gather(collect, return_exceptions=True)
        ticket.release()
    if collect.cancelled():
        return Response(status_code=499)  # nobody reads it
    collect.result()  # raises the request's HTTPError
    return JSONResponse(fmt.final(), headers=headers)


def _role(req: EngineRequest) -> str:
    p = req.kv_transfer_params or {}
    return ", prefill for a remote decode" if p.get("do_remote_decode") else \
        ", decode of a remote prefill" if p.get("do_remote_prefill") else ""


async def _run(state: ServerState, outputs: AsyncIterator[RequestOutput], req: EngineRequest,
               ticket: Ticket, timeout: float) -> AsyncIterator[RequestOutput]:
    """`outputs` of `req`, until they end; an HTTPError if it fails, is aborted by a drain or
    runs past `timeout` seconds (which aborts it and frees its KV)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    n, how = 0, "aborted (client gone)"
    try:
        while True:
            left = deadline - loop.time()
            try:
                out = await asyncio.wait_for(anext(outputs), None if timeout == float("inf")
                                             else max(left, 0))
            except StopAsyncIteration:
                return
            except TimeoutError:
                state.admission.timeouts.inc()
                how = f"aborted at its time limit ({timeout:g}s)"
                raise HTTPError(504, f"the request timed out after {timeout:g}s (server "
                                     "--request-timeout or the request's request_timeout); "
                                     f"{n} tokens were generated", "timeout") from None
            n += len(out.new_token_ids)
            if out.error:
                how = f"failed: {out.error}"
                raise HTTPError(500, out.error, "internal_error")
            if out.finish_reason == "abort":  # only a drain aborts a request we still read
                how = "aborted by the drain"
                raise HTTPError(503, "the request was aborted: the server is shutting down "
                                     "(--drain-timeout passed)", "service_unavailable")
            if out.finished:
                how = f"finished ({out.finish_reason})"
            yield out
    finally:
        await outputs.aclose()
        ticket.release()
        log.info("request %s: %s after %.2fs, %d tokens", req.request_id, how,
                 time.monotonic() - req.arrival_time, n)


async def _collect(fmt: _Format, outputs: AsyncIterator[RequestOutput]) -> None:
    async for out in outputs:
        fmt.add(out)


async def _disconnected(raw: Request) -> None:
    """Returns once the client has gone (the body is read, so the next message says so)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _sse(fmt: _Format, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    try:
        async for out in outputs:
            for chunk in fmt.chunks(out):
                yield _event(chunk)
    except HTTPError as e:
        yield _event(error_body(e.message, e.status, e.kind))
    finally:
        await outputs.aclose()
    yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Format:
    """Accumulates one request's outputs into OpenAI's response and stream-chunk shapes."""

    object_name = ""
    id_prefix = ""

    def __init__(self, state: ServerState, req: EngineRequest, body: _Body) -> None:
        self.state, self.req, self.body = state, req, body
        self.id = f"{self.id_prefix}-{req.request_id}"
        self.created = int(time.time())
        self.text = ""
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.tokens += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.last = out

    def usage(self) -> dict[str, int]:
        p, c = self.req.num_prompt_tokens, len(self.tokens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def envelope(self, choices: list[dict], final: bool = True) -> dict[str, Any]:
        suffix = "" if final else ".chunk"
        body: dict[str, Any] = {"id": self.id, "object": self.object_name + suffix,
                                "created": self.created, "model": self.state.model_name,
                                "choices": choices}
        if final:
            body["usage"] = self.usage()
            body["kv_transfer_params"] = self.last.kv_transfer_params if self.last else None
        return body

    def token_text(self, ids: list[int]) -> list[str]:
        return [self.state.tokenizer.decode([t]) for t in ids]

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        self.add(out)
        chunks = [self.envelope([self.delta(out)], final=False)]
        if out.finished:
            if out.kv_transfer_params is not None:
                chunks[-1]["kv_transfer_params"] = out.kv_transfer_params
            if self.body.include_usage:
                chunks.append({**self.envelope([], final=False), "usage": self.usage()})
        return chunks

    def delta(self, out: RequestOutput) -> dict[str, Any]:
        raise NotImplementedError

    def final(self) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionFormat(_Format):
    object_name = "text_completion"
    id_prefix = "cmpl"

    def _logprobs(self, ids: list[int], lps: list[float]) -> dict[str, Any] | None:
        if not self.req.params.logprobs:
            return None
        texts = self.token_text(ids)
        offsets, pos = [], len(self.text) - sum(map(len, texts))
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": texts, "token_logprobs": lps, "top_logprobs": None,
                "text_offset": offsets}

    def delta(self, out: RequestOutput) -> dict[str, Any]:
        return {"index": 0, "text": out.text, "finish_reason": out.finish_reason,
                "logprobs": self._logprobs(out.new_token_ids, out.new_logprobs)}

    def final(self) -> dict[str, Any]:
        reason = self.last.finish_reason if self.last else None
        return self.envelope([{"index": 0, "text": self.text, "finish_reason": reason,
                               "logprobs": self._logprobs(self.tokens, self.logprobs)}])


class _ChatFormat(_Format):
    object_name = "chat.completion"
    id_prefix = "chatcmpl"
    _sent_role = False

    def _logprobs(self, ids: list[int], lps: list[float]) -> dict[str, Any] | None:
        if not self.req.params.logprobs:
            return None
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": []}
                            for t, lp in zip(self.token_text(ids), lps, strict=True)]}

    def delta(self, out: RequestOutput) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": out.text}
        if not self._sent_role:
            delta["role"], self._sent_role = "assistant", True
        return {"index": 0, "delta": delta, "finish_reason": out.finish_reason,
                "logprobs": self._logprobs(out.new_token_ids, out.new_logprobs)}

    def final(self) -> dict[str, Any]:
        reason = self.last.finish_reason if self.last else None
        return self.envelope([{"index": 0, "finish_reason": reason,
                               "message": {"role": "assistant", "content": self.text},
                               "logprobs": self._logprobs(self.tokens, self.logprobs)}])


async def _http_error(raw: Request, exc: HTTPError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.status, exc.kind), status_code=exc.status,
                        headers={"X-Request-Id": request_id(raw)})


async def _validation_error(raw: Request, exc: RequestValidationError) -> JSONResponse:
    parts = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    message = "; ".join(parts) or "invalid request body"
    return JSONResponse(error_body(message, 400), status_code=400,
                        headers={"X-Request-Id": request_id(raw)})
