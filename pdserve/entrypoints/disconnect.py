"""Noticing a client that has gone while its answer is being made (server and proxy), so
that the work for it stops instead of going on for nobody."""

from __future__ import annotations

from fastapi import Request


async def disconnected(request: Request) -> None:
    """Returns once the client has gone. For a request whose body has been read: the next
    ASGI message then says so, with no polling."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
