"""The n choices of one request: their streams merged into one, their usage summed; on the
proxy, the body of each choice's own request and their SSE answers merged."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import TypeVar

from fastapi.responses import StreamingResponse

from pdserve.entrypoints.protocol import sse_event

T = TypeVar("T")


async def merge_streams(streams: list[AsyncGenerator[T]]) -> AsyncGenerator[T]:
    """Items of all `streams` as each arrives; closing the merged stream closes them all."""
    pending: dict[asyncio.Future, AsyncGenerator[T]] = {}
    try:
        if len(streams) == 1:  # the common case costs no tasks
            async for item in streams[0]:
                yield item
            return
        pending = {asyncio.ensure_future(anext(s)): s for s in streams}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                stream = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(stream))] = stream
                yield item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for s in streams:
            await s.aclose()


def sum_usage(usages: list[dict[str, int]]) -> dict[str, int]:
    """OpenAI's usage of n choices of one prompt: the prompt counted once."""
    prompt = usages[0]["prompt_tokens"]
    completion = sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def choice_body(body: dict, i: int) -> dict:
    """Choice i alone: n = 1 and, as a server seeds its choice i, seed + i."""
    seed = body.get("seed")
    return {**body, "n": 1, **({"seed": seed + i} if type(seed) is int else {})}


async def merged_events(answers: list[StreamingResponse]):
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
        yield sse_event(chunk)
    if usages:
        usage = {**usages[0], "usage": sum_usage([u["usage"] for u in usages])}
        yield sse_event(usage)
    yield "data: [DONE]\n\n"
