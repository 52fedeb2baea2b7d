"""OpenAI's response shapes: one request's outputs (its n choices) accumulated into a
completion or chat completion, whole or as stream chunks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.request import Request as EngineRequest
from pdserve.engine.request import RequestOutput, TopLogprobs
from pdserve.entrypoints.protocol import _Body
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


class ResponseFormat:
    """Accumulates one request's outputs (n choices) into OpenAI's response and stream-chunk
    shapes."""

    object_name = ""
    id_prefix = ""

    def __init__(self, model: str, tokenizer: Tokenizer, reqs: list[EngineRequest],
                 body: _Body, echo: str = "") -> None:
        self.model, self.tokenizer, self.body = model, tokenizer, body
        self.params = reqs[0].params
        self.num_prompt_tokens = reqs[0].num_prompt_tokens
        self.id = f"{self.id_prefix}-{reqs[0].request_id}"
        self.created = int(time.time())
        self.choices = {r.request_id: Choice(i) for i, r in enumerate(reqs)}
        self.kv_transfer_params: dict[str, Any] | None = None
        self.echo = echo  # text prepended to each choice (completions' echo)

    def add(self, out: RequestOutput) -> Choice:
        c = self.choices[out.request_id]
        c.text += out.text
        c.tokens += out.new_token_ids
        c.logprobs += out.new_logprobs
        c.top_logprobs += out.new_top_logprobs
        c.finish_reason = out.finish_reason
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params.to_dict()
        return c

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

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        c = self.add(out)
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
                  tops: list[TopLogprobs]) -> dict[str, Any] | None:
        if not self.params.logprobs:
            return None
        texts = self.token_text(ids)
        offsets, pos = [], len(c.text) - sum(map(len, texts))
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        # Each position's dict holds the chosen token and the k likeliest (OpenAI's k + 1).
        top = [{text: lp, **{self.tokenizer.decode([i]): v for i, v in t}}
               for text, lp, t in zip(texts, lps, tops or [[]] * len(ids), strict=True)]
        return {"tokens": texts, "token_logprobs": lps, "top_logprobs": top,
                "text_offset": offsets}

    def delta(self, c: Choice, out: RequestOutput) -> dict[str, Any]:
        return {"index": c.index, "text": (self.echo if not c.started else "") + out.text,
                "finish_reason": out.finish_reason,
                "logprobs": self._logprobs(c, out.new_token_ids, out.new_logprobs,
                                           out.new_top_logprobs)}

    def choice(self, c: Choice) -> dict[str, Any]:
        return {"index": c.index, "text": self.echo + c.text, "finish_reason": c.finish_reason,
                "logprobs": self._logprobs(c, c.tokens, c.logprobs, c.top_logprobs)}


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    id_prefix = "chatcmpl"

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
        delta: dict[str, Any] = {"content": out.text}
        if not c.started:
            delta["role"] = "assistant"
        return {"index": c.index, "delta": delta, "finish_reason": out.finish_reason,
                "logprobs": self._logprobs(out.new_token_ids, out.new_logprobs,
                                           out.new_top_logprobs)}

    def choice(self, c: Choice) -> dict[str, Any]:
        return {"index": c.index, "finish_reason": c.finish_reason,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c.tokens, c.logprobs, c.top_logprobs)}
