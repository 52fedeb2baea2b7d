"""The n choices of one request: their streams merged into one, their usage summed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import TypeVar

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
