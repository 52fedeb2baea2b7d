"""OpenAI's response shapes: one request's outputs (its n choices) accumulated into a
completion or chat completion, whole or as stream chunks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any

from pdserve.engine.request import PromptLogprob, RequestOutput, TopLogprobs
from pdserve.engine.request import Request as EngineRequest
from pdserve.entrypoints import tools
from pdserve.entrypoints.protocol import ChatCompletionRequest, _Body
from pdserve.entrypoints.tools import ToolCall
from pdserve.model.tokenizer import Tokenizer


@dataclass(slots=True)
class Choice:
    """One choice's output so far."""
    index: int
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False  # its first chunk went out (role, echo)
    sent: int = 0  # chat with tools: characters of `text` streamed as content so far


class ResponseFormat:
    """Accumulates one request's outputs (n choices) into OpenAI's response and stream-chunk
    shapes."""

    object_name = ""
    id_prefix = ""

    def __init__(self, model: str, tokenizer: Tokenizer, reqs: list[EngineRequest],
                 body: _Body, echo: str = "", prompt_only: bool = False) -> None:
        self.model, self.tokenizer, self.body = model, tokenizer, body
        self.params = reqs[0].params
        self.prompt_ids = reqs[0].prompt_token_ids
        self.num_prompt_tokens = reqs[0].num_prompt_tokens
        self.id = f"{self.id_prefix}-{reqs[0].request_id}"
        self.created = int(time.time())
        self.choices = {r.request_id: Choice(i) for i, r in enumerate(reqs)}
        self.kv_transfer_params: dict[str, Any] | None = None
        self.prompt_logprobs: list[PromptLogprob] = []  # prompt tokens 1.., once they come
        self.echo = echo  # text prepended to each choice (completions' echo)
        # echo with max_tokens 0: the engine samples one token, which the answer leaves out
        self.prompt_only = prompt_only

    def add(self, out: RequestOutput) -> tuple[Choice, RequestOutput]:
        """Take in one output: its choice, and the output as the answer shows it."""
        if self.prompt_only:
            out = replace(out, new_token_ids=[], new_logprobs=[], text="",
                                      new_top_logprobs=[])
        c = self.choices[out.request_id]
        c.text += out.text
        c.tokens += out.new_token_ids
        c.logprobs += out.new_logprobs
        c.top_logprobs += out.new_top_logprobs
        c.finish_reason = out.finish_reason
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params.to_dict()
        return c, out

    def usage(self) -> dict[str, int]:
        p, c = self.num_prompt_tokens, sum(len(c.tokens) for c in self.choices.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def envelope(self, choices: list[dict], final: bool = True) -> dict[str, Any]:
        suffix = "" if final else ".chunk"
        body: dict[str, Any] = {"id": self.id, "object": self.object_name + suffix,
                                "created": self.created, "model": self.model,
                                "choices": choices}
        if final:
            body["usage"] = self.usage()
            body["kv_transfer_params"] = self.kv_transfer_params
        return body

    def token_text(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in ids]

    def vllm_prompt_logprobs(self) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's `prompt_logprobs`: null for the first token, then per prompt token a dict
        token id -> {logprob, rank, decoded_token} of that token and the k likeliest."""
        if self.params.prompt_logprobs is None:
            return None
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for token, e in zip(self.prompt_ids[1:], self.prompt_logprobs, strict=True):
            ranked = [(token, e.logprob, e.rank)] + [(t, lp, r) for r, (t, lp) in
                                                     enumerate(e.top, 1)]
            entry: dict[str, dict[str, Any]] = {}
            for t, lp, rank in ranked:  # the prompt's token first, as vLLM
                entry.setdefault(str(t), {"logprob": lp, "rank": rank,
                                          "decoded_token": self.tokenizer.decode([t])})
            out.append(entry)
        return out

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        c, out = self.add(out)
        chunks = [self.envelope([self.delta(c, out)], final=False)]
        c.started = True
        if out.finished:
            if out.kv_transfer_params is not None:
                chunks[-1]["kv_transfer_params"] = out.kv_transfer_params.to_dict()
            last = all(c.finish_reason for c in self.choices.values())
            if last and self.body.include_usage:  # OpenAI: one chunk after every choice
                chunks.append({**self.envelope([], final=False), "usage": self.usage()})
        return chunks

    def final(self) -> dict[str, Any]:
        return self.envelope([self.choice(c) for c in self.choices.values()])

    def delta(self, c: Choice, out: RequestOutput) -> dict[str, Any]:
        raise NotImplementedError

    def choice(self, c: Choice) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    id_prefix = "cmpl"

    def _logprobs(self, c: Choice, ids: list[int], lps: list[float],
                  tops: list[TopLogprobs], first: bool) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs of output tokens `ids`; led by the prompt's tokens in
        the choice's `first` piece when echoed."""
        if not self.params.logprobs:
            return None
        texts = self.token_text(ids)
        out = {"tokens": texts, "token_logprobs": list(lps),
               "top_logprobs": [self._top(*e) for e in
                                zip(texts, lps, tops or [[]] * len(ids), strict=True)]}
        # Offsets into the choice's text (echo included), each token's after the last's.
        start = len(self.echo) + len(c.text) - sum(map(len, texts))
        if first and self.echo:
            prompt = self._echoed_prompt()
            out = {k: prompt[k] + v for k, v in out.items()}
            start = 0
        out["text_offset"] = list(accumulate(map(len, out["tokens"][:-1]), initial=start)) \
            if out["tokens"] else []
        return out

    def _top(self, text: str, logprob: float, top: TopLogprobs) -> dict[str, float]:
        """One position's dict: the chosen token and the k likeliest (OpenAI's k + 1)."""
        return {text: logprob, **{self.tokenizer.decode([i]): v
                                  for i, v in top[:self.params.top_logprobs]}}

    def _echoed_prompt(self) -> dict[str, list]:
        """The prompt's part of echoed logprobs: its first token has none (null), as
        OpenAI's and vLLM's."""
        texts = self.token_text(self.prompt_ids)
        return {"tokens": texts,
                "token_logprobs": [None] + [e.logprob for e in self.prompt_logprobs],
                "top_logprobs": [None] + [self._top(t, e.logprob, e.top) for t, e in
                                          zip(texts[1:], self.prompt_logprobs, strict=True)]}

    def delta(self, c: Choice, out: RequestOutput) -> dict[str, Any]:
        first = not c.started
        return {"index": c.index, "text": (self.echo if first else "") + out.text,
                "finish_reason": out.finish_reason,
                "logprobs": self._logprobs(c, out.new_token_ids, out.new_logprobs,
                                           out.new_top_logprobs, first)}

    def choice(self, c: Choice) -> dict[str, Any]:
        choice = {"index": c.index, "text": self.echo + c.text,
                  "finish_reason": c.finish_reason,
                  "logprobs": self._logprobs(c, c.tokens, c.logprobs, c.top_logprobs, True)}
        if self.params.prompt_logprobs is not None:  # vLLM's, on each choice
            choice["prompt_logprobs"] = self.vllm_prompt_logprobs()
        return choice


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    id_prefix = "chatcmpl"

    def __init__(self, model: str, tokenizer: Tokenizer, reqs: list[EngineRequest],
                 body: ChatCompletionRequest) -> None:
        super().__init__(model, tokenizer, reqs, body)
        self.tool_mode, self.tool_names = body.tool_mode(), body.tool_names

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _logprobs(self, ids: list[int], lps: list[float],
                  tops: list[TopLogprobs]) -> dict[str, Any] | None:
        if not self.params.logprobs:
            return None
        return {"content": [{**self._entry(t, lp),
                             "top_logprobs": [self._entry(*e) for e in top]}
                            for t, lp, top in zip(ids, lps, tops or [[]] * len(ids),
                                                  strict=True)]}

    def delta(self, c: Choice, out: RequestOutput) -> dict[str, Any]:
        content, calls = (out.text, []) if self.tool_mode == "none" else \
            self._tool_delta(c, out.finished)
        delta: dict[str, Any] = {"content": content}
        if not c.started:
            delta["role"] = "assistant"
        if calls:
            delta["tool_calls"] = [call.to_dict(i) for i, call in enumerate(calls)]
        return {"index": c.index, "delta": delta,
                "finish_reason": "tool_calls" if calls else out.finish_reason,
                "logprobs": self._logprobs(out.new_token_ids, out.new_logprobs,
                                           out.new_top_logprobs)}

    def choice(self, c: Choice) -> dict[str, Any]:
        content, calls = self._parsed(c)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.to_dict() for call in calls]
        return {"index": c.index, "finish_reason": "tool_calls" if calls else c.finish_reason,
                "message": message,
                "logprobs": self._logprobs(c.tokens, c.logprobs, c.top_logprobs)}

    def _parsed(self, c: Choice) -> tuple[str | None, list[ToolCall]]:
        """A choice's content and tool calls, once it has ended."""
        if self.tool_mode == "none" or c.finish_reason not in ("stop", "length"):
            return c.text, []
        return tools.parse(c.text, self.tool_mode, self.tool_names)

    def _tool_delta(self, c: Choice, final: bool) -> tuple[str, list[ToolCall]]:
        """What a stream chunk carries when tools are offered: content up to where a call
        may begin (none while a call is enforced), and at the end the rest or the calls."""
        if final:
            content, calls = self._parsed(c)
            rest = (content or "")[c.sent:] if calls else c.text[c.sent:]
            return rest, calls
        cut = tools.streamable(c.text) if self.tool_mode == "auto" else 0
        new = c.text[c.sent:max(cut, c.sent)]
        c.sent += len(new)
        return new, []

    def final(self) -> dict[str, Any]:
        body = super().final()
        if self.params.prompt_logprobs is not None:  # vLLM's, on the response for chat
            body["prompt_logprobs"] = self.vllm_prompt_logprobs()
        return body
