"""OpenAI-compatible HTTP server in front of one engine."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
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
from pdserve.engine.structured import GrammarError, Grammars, GrammarSpec
from pdserve.entrypoints import tools
from pdserve.entrypoints.admission import Admission, Ticket
from pdserve.entrypoints.body_limit import DEFAULT_MAX_BYTES, BodyLimit
from pdserve.entrypoints.disconnect import disconnected
from pdserve.entrypoints.openai_format import ChatFormat, CompletionFormat, ResponseFormat
from pdserve.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Body,
    error_body,
    require_api_key,
    sse_event,
    valid_request_id,
)
from pdserve.entrypoints.streams import merge_streams
from pdserve.kv_transfer.params import KVParams
from pdserve.model.tokenizer import Tokenizer

log = logging.getLogger("pdserve.api")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


@dataclass(slots=True)
class ServerState:
    engine: StreamingClient  # AsyncEngine, or DPEngine over engine-rank processes
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    # Structured output's compiler: the engine's own where it runs in this process, so what
    # a handler compiles the engine then finds in the cache.
    grammars: Grammars
    validate_kv_params: Callable[[KVParams, int], None] | None = None
    kv_info: Callable[[], list[dict[str, Any]]] | None = None
    api_key: str | None = None
    served_model_names: list[str] = field(default_factory=list)  # default: [model_name]
    admission: Admission = field(default_factory=Admission)
    request_timeout: float | None = None  # seconds; a request's own may be shorter
    max_request_bytes: int = DEFAULT_MAX_BYTES
    # Frees a remote prefill's blocks for kv_transfer_params we will not read (blocking; it
    # contacts only hosts the params validator allows).
    release_remote: Callable[[KVParams], None] | None = None

    @property
    def names(self) -> list[str]:
        return self.served_model_names or [self.model_name]


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="pdserve")
    app.add_middleware(BodyLimit, max_bytes=state.max_request_bytes)
    app.state.pd = state
    app.add_exception_handler(HTTPError, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    require_api_key(app, state.api_key)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.admission.draining:  # load balancers take it out of rotation
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.engine.healthy():
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        text = await state.engine.metrics() + generate_latest(state.admission.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "pdserve",
            "max_model_len": state.max_model_len} for name in state.names]}

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
        grammar = await _grammar(state, body)
        ids = await _encode(state, prompt) if isinstance(prompt, str) else prompt
        reqs = _engine_requests(state, body, ids, body.generated_tokens, raw, grammar)
        echo = "" if not body.echo else prompt if isinstance(prompt, str) else \
            state.tokenizer.decode(ids)
        fmt = CompletionFormat(state.names[0], state.tokenizer, reqs, body, echo,
                               prompt_only=body.max_tokens == 0)
        return await _respond(state, reqs, body, raw, fmt)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        grammar = await _grammar(state, body)
        offered = body.tool_dicts() if body.tool_mode() != "none" else None
        ids = await _encode(state, _chat_text(state, body.messages, offered))
        max_tokens = body.max_completion_tokens or body.max_tokens or \
            max(state.max_model_len - len(ids), 1)
        reqs = _engine_requests(state, body, ids, max_tokens, raw, grammar)
        fmt = ChatFormat(state.names[0], state.tokenizer, reqs, body)
        return await _respond(state, reqs, body, raw, fmt)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        _check_model(state, body.model)
        text = body.prompt if body.messages is None else \
            _chat_text(state, body.messages, add_generation_prompt=body.add_generation_prompt)
        ids = await _encode(state, text, body.special_tokens)
        answer = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        if body.return_token_strs:
            answer["token_strs"] = state.tokenizer.token_strs(ids)
        return answer

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        _check_model(state, body.model)
        _check_ids(state, body.tokens, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    return app


async def _grammar(state: ServerState, body: _Body) -> GrammarSpec | None:
    """The request's structured-output spec, compiled here (off the event loop, and before
    the engine sees it, so a large schema stalls no batch) or refused with a 400."""
    try:
        spec = body.grammar()
    except ValueError as e:
        raise HTTPError(400, str(e)) from None
    if spec is None:
        return None
    try:
        await asyncio.to_thread(state.grammars.compile, spec)
    except GrammarError as e:
        raise HTTPError(400, f"invalid structured output ({spec.kind}): {e}") from None
    return spec


def _chat_text(state: ServerState, messages: list[ChatMessage],
               offered: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
    """The prompt the chat template makes of `messages` and the tools offered (described
    in the system message where the template does not render them)."""
    turns = [m.for_template() for m in messages]
    if offered and not state.tokenizer.template_takes_tools:
        turns = tools.prompt_messages(turns, offered)
    try:
        return state.tokenizer.apply_chat_template(turns, offered, add_generation_prompt)
    except ValueError as e:
        raise HTTPError(400, f"cannot apply the chat template: {e}") from None


def _check_model(state: ServerState, model: str | None) -> None:
    if model and model not in state.names:
        raise HTTPError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def _check_ids(state: ServerState, ids: list[int], what: str) -> None:
    if any(not 0 <= t < state.tokenizer.vocab_size for t in ids):
        raise HTTPError(400, f"{what} must be in [0, {state.tokenizer.vocab_size})")


async def _encode(state: ServerState, text: str, add_special_tokens: bool = True
                  ) -> list[int]:
    """Token ids of a prompt, tokenized off the event loop (a long prompt takes seconds,
    which /health and every stream would otherwise wait out)."""
    # No token covers more characters than the vocabulary's longest, so a text longer than
    # that many per context position cannot fit: refused before any of it is tokenized.
    if len(text) > state.max_model_len * state.tokenizer.max_token_chars:
        raise HTTPError(400, f"This model's maximum context length is {state.max_model_len} "
                             f"tokens; a prompt of {len(text)} characters is longer than that "
                             "many tokens can be.")
    try:  # JSON may carry lone surrogates ("\\ud800"), which no tokenizer takes
        text.encode()
    except UnicodeEncodeError as e:
        raise HTTPError(400, f"the prompt is not valid Unicode: {e.reason} at "
                             f"position {e.start}") from None
    return await asyncio.to_thread(state.tokenizer.encode, text, add_special_tokens)


def _engine_requests(state: ServerState, body: _Body, ids: list[int], max_tokens: int,
                     raw: Request, grammar: GrammarSpec | None) -> list[EngineRequest]:
    """One engine request per choice."""
    _check_model(state, body.model)
    if not ids:  # some text (a lone control character, say) has no tokens at all
        raise HTTPError(400, "the prompt is empty once tokenized: it has no tokens")
    _check_ids(state, ids, "prompt token ids")
    if len(ids) + max_tokens > state.max_model_len:
        raise HTTPError(400, f"This model's maximum context length is {state.max_model_len} "
                             f"tokens; you requested {len(ids) + max_tokens} ({len(ids)} in "
                             f"the prompt, {max_tokens} to generate).")
    params = _kv_params(state, body, len(ids))
    if (given := raw.headers.get("x-request-id")) is not None and \
            not valid_request_id(given):
        raise HTTPError(400, "X-Request-Id must be 1 to 256 printable ASCII characters")
    # The engine's ids keep the client's X-Request-Id (so every log line about the request
    # names it) plus a suffix: one server may see the same id twice (prefill and decode,
    # or the choices of n).
    return [EngineRequest(f"{request_id(raw)}-{uuid.uuid4().hex[:8]}", ids,
                          body.sampling_params(max_tokens, i, grammar), params)
            for i in range(body.n)]


def _kv_params(state: ServerState, body: _Body, prompt_len: int) -> KVParams | None:
    given = {k: v for k, v in (body.kv_transfer_params or {}).items() if v is not None}
    try:
        params = KVParams.from_dict(given) if given else None
    except ValueError as e:
        raise HTTPError(400, f"invalid kv_transfer_params: {e}") from None
    try:
        if params is not None and state.validate_kv_params is not None:
            state.validate_kv_params(params, prompt_len)
    except ValueError as e:
        _release(state, params)
        raise HTTPError(400, f"invalid kv_transfer_params: {e}") from None
    if params and body.n > 1:  # a prefill answers one set of params per request
        _release(state, params)
        raise HTTPError(400, "n > 1 cannot be combined with kv_transfer_params; send n "
                             "requests (pdserve's proxy does)")
    return params


def _release(state: ServerState, p: KVParams | None) -> None:
    """Let a remote prefill free the blocks of a request refused here: its engine never
    sees it, so nothing else would before the lease ends (under overload, when its blocks
    are needed most)."""
    if p is not None and p.do_remote_prefill and state.release_remote is not None:
        asyncio.get_running_loop().run_in_executor(None, state.release_remote, p)


def _release_refused(state: ServerState, body: Any) -> None:
    """A body refused before it is read may name a prefill's KV (a decode may refuse what a
    prefill took: the proxy sends the prefill `stream: false`): let the prefill free it."""
    given = body.get("kv_transfer_params") if isinstance(body, dict) else None
    if isinstance(given, dict):
        with suppress(ValueError, TypeError):  # (from_dict skips nulls itself)
            _release(state, KVParams.from_dict(given))


def request_id(raw: Request) -> str:
    """The client's X-Request-Id, or one made up for this request (echoed in the answer)."""
    if not hasattr(raw.state, "request_id"):
        given = raw.headers.get("x-request-id", "")
        raw.state.request_id = given if valid_request_id(given) else uuid.uuid4().hex
    return raw.state.request_id


async def _respond(state: ServerState, reqs: list[EngineRequest], body: _Body, raw: Request,
                   fmt: ResponseFormat) -> Response:
    ticket = state.admission.admit()
    if not isinstance(ticket, Ticket):
        log.warning("request %s: refused with %d: %s", reqs[0].request_id, *ticket)
        _release(state, reqs[0].kv_transfer_params)
        raise HTTPError(*ticket, "rate_limit_exceeded" if ticket[0] == 429 else
                        "service_unavailable")
    for req in reqs:
        log.info("request %s: %d prompt tokens, max_tokens %d%s", req.request_id,
                 req.num_prompt_tokens, req.params.max_tokens, _role(req))
    timeout = min(t for t in (state.request_timeout, body.request_timeout, float("inf"))
                  if t is not None)
    streams = merge_streams([state.engine.generate(r) for r in reqs])
    outputs = _released(_run(state, streams, reqs[0], timeout), ticket)
    headers = {"X-Request-Id": request_id(raw)}
    if body.stream:  # Starlette cancels the stream when the client goes
        return StreamingResponse(_sse(fmt, outputs), media_type="text/event-stream",
                                 headers=headers, background=BackgroundTask(ticket.release))
    collect = asyncio.ensure_future(_collect(fmt, outputs))
    gone = asyncio.ensure_future(disconnected(raw))
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
    p = req.kv_transfer_params
    return "" if p is None else ", prefill for a remote decode" if p.do_remote_decode else \
        ", decode of a remote prefill" if p.do_remote_prefill else ""


async def _released(outputs: AsyncIterator[RequestOutput],
                    ticket: Ticket) -> AsyncIterator[RequestOutput]:
    """`outputs`, releasing the request's admission ticket when they end, however."""
    try:
        async for out in outputs:
            yield out
    finally:
        await outputs.aclose()
        ticket.release()


async def _run(state: ServerState, outputs: AsyncIterator[RequestOutput], req: EngineRequest,
               timeout: float) -> AsyncIterator[RequestOutput]:
    """`outputs` of `req` (all its choices), until they end; an HTTPError if it fails, is
    aborted by a drain or runs past `timeout` seconds (which aborts it and frees its KV)."""
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
        log.info("request %s: %s after %.2fs, %d tokens", req.request_id, how,
                 time.monotonic() - req.arrival_time, n)


async def _collect(fmt: ResponseFormat, outputs: AsyncIterator[RequestOutput]) -> None:
    async for out in outputs:
        fmt.add(out)


async def _sse(fmt: ResponseFormat, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    try:
        async for out in outputs:
            for chunk in fmt.chunks(out):
                yield sse_event(chunk)
    except HTTPError as e:
        yield sse_event(error_body(e.message, e.status, e.kind))
    finally:
        await outputs.aclose()
    yield "data: [DONE]\n\n"


async def _http_error(raw: Request, exc: HTTPError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.status, exc.kind, exc.param),
                        status_code=exc.status, headers={"X-Request-Id": request_id(raw)})


async def _validation_error(raw: Request, exc: RequestValidationError) -> JSONResponse:
    _release_refused(raw.app.state.pd, exc.body)
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON "
                         f"({err.get('ctx', {}).get('error', 'decode error')})")
            continue
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    message = "; ".join(parts) or "invalid request body"
    return JSONResponse(error_body(message, 400), status_code=400,
                        headers={"X-Request-Id": request_id(raw)})
