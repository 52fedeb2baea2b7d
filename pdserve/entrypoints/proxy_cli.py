"""`pdserve proxy`'s command line: its flags, and run(), which builds the prefill and decode
pools from them and serves the proxy's app."""

from __future__ import annotations

import argparse
import logging
import os
import socket

import httpx

from pdserve.config import ConfigError
from pdserve.entrypoints.body_limit import add_body_limit_arg, check_body_limit
from pdserve.entrypoints.discovery import Discovery, named_host
from pdserve.entrypoints.pd_flow import Proxy
from pdserve.entrypoints.protocol import CLIENT_KEEPALIVE_EXPIRY_S, SERVER_KEEP_ALIVE_S
from pdserve.entrypoints.proxy import build_app
from pdserve.entrypoints.routing import (
    Backend,
    Disaggregation,
    Pool,
    PromptTokens,
    add_routing_args,
    check_routing_args,
)

log = logging.getLogger("pdserve.proxy")


def add_parser(sub) -> None:
    p = sub.add_parser("proxy", help="route requests prefill -> decode")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--resolve-every", type=float, default=None, metavar="SECONDS",
                   help="discovery: a backend URL naming a host (a Kubernetes headless "
                        "Service) stands for every address the name resolves to, resolved "
                        "again every SECONDS: instances that join are used, those that leave "
                        "dropped (default: off, URLs used as given)")
    p.add_argument("--backend-keepalive", type=int, default=10, metavar="SECONDS",
                   help="a backend connection silent this long is probed (TCP keepalive); "
                   "one whose host left the network is given up about 2.5x later, and its "
                   "stream ends with an error (default: 10)")
    add_routing_args(p)
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    p.add_argument("--backend-api-key", default=None, help="default: --api-key")
    add_body_limit_arg(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Here, not at the top: every `pdserve` command imports this module for its parser,
    # and only this one serves (or needs the loader, which imports torch).
    import uvicorn

    from pdserve.model.loader import ModelLoadError

    if problem := check_routing_args(args) or check_body_limit(args.max_request_bytes) \
            or _check_discovery(args) or _check_keepalive(args.backend_keepalive):
        raise ConfigError(problem)
    discovered = args.resolve_every is not None

    def pool(name: str, urls: list[str]) -> Pool:
        backends = [] if discovered else [Backend(u.rstrip("/")) for u in urls]
        return Pool(name, backends, args.policy, args.prefix_max_imbalance)

    try:  # token counts only where routing needs them: the tokenizer costs a torch import
        counted = args.policy == "prefix" or args.local_prefill_below is not None
        prompt_tokens = PromptTokens(args.tokenizer) if counted else None
    except ModelLoadError as e:
        raise ConfigError(f"cannot load the tokenizer: {e}") from None
    # No read timeout: a long prompt or a long answer may be silent for minutes. A backend
    # whose node or network is gone never answers again, though: keepalive probes find that.
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100,
                          keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S)
    transport = httpx.AsyncHTTPTransport(limits=limits,
                                         socket_options=keepalive(args.backend_keepalive))
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), transport=transport)
    proxy = Proxy(pool("prefill", args.prefill), pool("decode", args.decode), client,
                  args.api_key, args.backend_api_key or args.api_key,
                  Disaggregation(args.local_prefill_below, args.max_prefill_queue),
                  prompt_tokens, args.prefix_tokens)
    discovery = Discovery([(proxy.prefill, [u.rstrip("/") for u in args.prefill]),
                           (proxy.decode, [u.rstrip("/") for u in args.decode])],
                          args.resolve_every) if discovered else None
    log.info("proxy on http://%s:%d: prefill %s, decode %s, policy %s, %s%s", args.host,
             args.port, " ".join(args.prefill), " ".join(args.decode), args.policy,
             proxy.disagg, f", names resolved every {args.resolve_every}s" if discovered else "")
    uvicorn.run(build_app(proxy, args.max_request_bytes, discovery), host=args.host,
                port=args.port, log_level="warning", timeout_keep_alive=SERVER_KEEP_ALIVE_S)
    return 0


def _check_keepalive(seconds: int) -> str | None:
    if seconds < 1:
        return f"--backend-keepalive must be at least 1 second, not {seconds}"
    return None


def keepalive(seconds: int) -> list[tuple[int, int, int]]:
    """Socket options: probe after `seconds` of silence, then every seconds / 2, and give up
    after 3 unanswered probes."""
    return [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
            (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, seconds),
            (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, seconds // 2)),
            (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)]


def _check_discovery(args: argparse.Namespace) -> str | None:
    if args.resolve_every is None:
        return None
    if not args.resolve_every > 0:
        return f"--resolve-every must be a positive number of seconds, not {args.resolve_every}"
    for url in args.prefill + args.decode:
        if url.startswith("https:") and named_host(url):
            return (f"--resolve-every replaces {url}'s host name with its addresses, which "
                    "TLS cannot verify: give http:// URLs (or IP addresses)")
    return None
