"""A bound on request bodies: one over the limit is refused with a 413 before any of it is
parsed, so that a huge body costs neither the parser's nor the tokenizer's time."""

from __future__ import annotations

import json

from pdserve.entrypoints.protocol import error_body

DEFAULT_MAX_BYTES = 8 * 2**20


def add_body_limit_arg(p) -> None:
    """--max-request-bytes, as the server and the proxy take it."""
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help="larger request bodies get 413 before they are parsed "
                        "(default %(default)s: 8 MiB)")


def check_body_limit(max_bytes: int) -> str | None:
    """What is wrong with a --max-request-bytes value, if anything."""
    return None if max_bytes >= 1 else f"--max-request-bytes must be positive, got {max_bytes}"


class BodyLimit:
    """ASGI middleware: reads a request's body (counting, as a chunked one has no length)
    and hands it on whole, or answers 413."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send, int(length))
            return
        parts, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left: the app will see it
                first = msg
                break
            parts.append(msg.get("body", b""))
            size += len(parts[-1])
            if size > self.max_bytes:
                await self._refuse(send, size)
                return
            if not msg.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(parts), "more_body": False}
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # then the disconnect, when it comes
            replayed = True
            return first

        await self.app(scope, replay, send)

    async def _refuse(self, send, size: int) -> None:
        body = json.dumps(error_body(
            f"the request body has {size} bytes or more; this server takes at most "
            f"{self.max_bytes} (--max-request-bytes)", 413)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
