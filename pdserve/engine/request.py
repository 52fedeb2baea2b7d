"""A request's sampling parameters and its life in the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from pdserve.engine.structured import GrammarSpec
from pdserve.kv_transfer.params import KVParams, PromptLogprob, TopLogprobs


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # the chosen token's logprob
    top_logprobs: int = 0  # and the k most likely tokens' (needs logprobs)
    prompt_logprobs: int | None = None  # each prompt token's logprob, and the k likeliest
    presence_penalty: float = 0.0  # OpenAI's: over generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF's: over prompt and generated tokens
    grammar: GrammarSpec | None = None  # structured output: what the text must match

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or \
            self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


class Status(Enum):
    WAITING = auto()
    WAITING_FOR_REMOTE_KV = auto()  # blocks allocated, KV being pulled from a prefill
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: KVParams | None = None
    response_kv_params: KVParams | None = None  # a prefill's answer for the decode
    load_remote: bool = False  # its prompt KV is to be pulled from a remote prefill
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)  # if asked for
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)  # tokens 1.. so far
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, so far
    num_registered_blocks: int = 0  # of its blocks, those named in the prefix cache
    shareable: bool = True  # False: its blocks lack some layers' K/V (a windowed pull)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    penalty_prompt_ids: Any = None  # the sampler's: its prompt's distinct ids, as a tensor
    matcher: Any = None  # its grammar's state (an xgrammar GrammarMatcher), made by the engine

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:  # a step of zero tokens would fail its whole batch
            raise ValueError(f"request {self.request_id}: the prompt has no tokens")
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs that are not all computed (or received) yet."""
        return self.params.prompt_logprobs is not None and \
            len(self.prompt_logprobs) < self.num_prompt_tokens - 1


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    text: str  # new text since the previous output
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    kv_transfer_params: KVParams | None = None
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)  # if asked for
    prompt_logprobs: list[PromptLogprob] | None = None  # with the first token, if asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
