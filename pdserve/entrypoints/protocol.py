"""OpenAI-compatible request bodies (plus vLLM's extensions: kv_transfer_params, top_k,
ignore_eos, stop_token_ids, structured_outputs), the error body, and the HTTP rules server
and proxy share (request ids, API keys)."""

from __future__ import annotations

import hmac
import json
import re
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdserve.engine.request import SamplingParams
from pdserve.engine.structured import GrammarSpec
from pdserve.entrypoints import tools

# Servers keep an idle HTTP connection open longer than the clients' pools keep one (httpx's
# default, and the proxy's backend pool: 5 s), so the client closes it first: a request sent
# on a connection the server is closing that instant is lost (a ReadError; the proxy lost a
# prefill so under load and prefilled it locally).
SERVER_KEEP_ALIVE_S = 75
CLIENT_KEEPALIVE_EXPIRY_S = 5.0

MAX_LOGPROBS = 20  # top logprobs per position, as vLLM's default max_logprobs
MAX_N = 128  # choices per request, as OpenAI's
# A request id goes into backends' headers, response headers and log lines: printable
# ASCII only, and not too long to read.
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    # `schema` would shadow a BaseModel attribute; the output follows it, strict or not.
    json_schema: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormatParam(BaseModel):
    """OpenAI's response_format."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormatParam:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self

    def spec(self) -> GrammarSpec | None:
        if self.type == "json_object":
            return GrammarSpec("json_object")
        return GrammarSpec.json_schema(self.json_schema.json_schema) if self.json_schema \
            else None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one constraint."""
    model_config = ConfigDict(extra="forbid")  # an option we do not apply must not pass
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, "
                             f"grammar; got {len(given)}")
        return self

    def spec(self) -> GrammarSpec:
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.choice is not None:
            return GrammarSpec.choices(self.choice)
        if self.grammar is not None:
            return GrammarSpec("grammar", self.grammar)
        schema = self.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        return GrammarSpec.json_schema(schema)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields we do not use

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # Bounded away from 0 and infinity: past those, penalised logits overflow float32.
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=100.0)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    request_timeout: float | None = Field(default=None, gt=0)  # s; pdserve's extension
    response_format: ResponseFormatParam | None = None
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("stream"):
            raise ValueError("`prompt_logprobs` are not available when `stream=True`")
        return v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None and any(s == "" for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("stop strings must not be empty")
        return v

    def grammar(self) -> GrammarSpec | None:
        """What the output must match, if anything; ValueError for a contradiction."""
        fmt = self.response_format.spec() if self.response_format else None
        if fmt is not None and self.structured_outputs is not None:
            raise ValueError("send response_format or structured_outputs, not both")
        return self.structured_outputs.spec() if self.structured_outputs else fmt

    def sampling_params(self, max_tokens: int, index: int = 0,
                        grammar: GrammarSpec | None = None) -> SamplingParams:
        """Choice `index`'s parameters: with a seed, choice i draws from seed + i (as vLLM),
        so each choice is its own reproducible stream."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        logprobs, top = self.logprobs_asked()
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            # Any k past the vocabulary keeps every token; clamped so the sampler's int64
            # tensor never overflows (a 500 for every request in the batch).
            top_k=min(max(self.top_k, 0), 2**31),
            seed=None if self.seed is None else self.seed + index, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, top_logprobs=top, prompt_logprobs=self.prompt_logprobs_asked(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, grammar=grammar)

    def logprobs_asked(self) -> tuple[bool, int]:
        """(the chosen tokens' logprobs?, how many top logprobs per position)"""
        raise NotImplementedError

    def prompt_logprobs_asked(self) -> int | None:
        """Top logprobs per prompt position, None for no prompt logprobs."""
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    # 0 with echo (vLLM's): the prompt and its logprobs alone, nothing generated.
    max_tokens: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _zero_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo: true, which "
                             "returns the prompt and its logprobs alone)")
        return self

    def logprobs_asked(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    def prompt_logprobs_asked(self) -> int | None:
        # echo with logprobs lists the prompt's tokens too (OpenAI's legacy shape)
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def generated_tokens(self) -> int:
        """max_tokens as the engine runs it: echo with max_tokens 0 samples one token,
        which the answer leaves out (as vLLM)."""
        return 1 if self.max_tokens == 0 else self.max_tokens or 16

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise ValueError("send one prompt per request (batched prompts are not "
                                 "supported)")
            p = p[0]
        if isinstance(p, str | list) and len(p) == 0:
            raise ValueError("prompt must not be empty")
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: tool calls and results keep their ids."""
        extra = {k: v for k, v in (self.model_extra or {}).items()
                 if k in ("tool_calls", "tool_call_id", "name") and v is not None}
        return {"role": self.role, "content": self.text(), **extra}


class Function(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and \
                choice.function.name not in self.tool_names:
            raise ValueError(f"tool_choice names function `{choice.function.name}`, which is "
                             "not among the tools")
        return self

    @property
    def tool_names(self) -> set[str]:
        return {t.function.name for t in self.tools or []}

    def tool_mode(self) -> str | dict[str, Any]:
        """"none" (no tools), "auto", "required" or a named choice as a dict: OpenAI's
        default is auto where tools are given."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice or "auto"

    def grammar(self) -> GrammarSpec | None:
        spec = super().grammar()
        tool = tools.grammar(self.tool_dicts(), self.tool_mode())
        if spec is not None and tool is not None:
            raise ValueError("a required or named tool_choice cannot be combined with "
                             "response_format or structured_outputs")
        return tool or spec

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true")
        return v

    def logprobs_asked(self) -> tuple[bool, int]:
        return self.logprobs, self.top_logprobs or 0


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    # vLLM's defaults: a prompt's special tokens are added, the chat template writes its own.
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either `prompt` or `messages`")
        return self

    @property
    def special_tokens(self) -> bool:
        return self.messages is None if self.add_special_tokens is None \
            else self.add_special_tokens


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


def error_body(message: str, code: int, kind: str = "invalid_request_error",
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error"
                   ) -> JSONResponse:
    return JSONResponse(error_body(message, status, kind), status_code=status)


def sse_event(obj: dict) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def valid_request_id(request_id: str) -> bool:
    """Whether a client's X-Request-Id can be used as it is (server and proxy alike)."""
    return _REQUEST_ID.fullmatch(request_id) is not None


def require_api_key(app: FastAPI, key: str | None) -> None:
    """OpenAI-style Bearer auth on /v1/* (health and metrics stay open for probes)."""
    if not key:
        return
    expected = f"Bearer {key}".encode()

    @app.middleware("http")
    async def auth(request: Request, call_next):
        # As bytes: compare_digest raises on non-ASCII str, which made a 500 of a bad key.
        given = request.headers.get("authorization", "").encode("latin-1")
        if request.url.path.startswith("/v1/") and not hmac.compare_digest(given, expected):
            return JSONResponse(error_body("invalid or missing API key", 401,
                                           "authentication_error"), status_code=401)
        return await call_next(request)
