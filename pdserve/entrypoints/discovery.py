"""Backends found by name (`pdserve proxy --resolve-every`): a backend URL whose host is a
DNS name, such as a Kubernetes headless Service's, stands for every address the name
resolves to. Re-resolved every few seconds, instances that join are used and those that
leave are dropped without restarting the proxy; URLs with an IP address stay as given."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pdserve.entrypoints.routing import Pool

log = logging.getLogger("pdserve.proxy")

# The resolver's answers for a name with no address (a headless Service without ready
# pods): the tier is empty now. Any other failure keeps the addresses found last.
_NO_ADDRESS = frozenset({socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)})

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` names, through the system's resolver (/etc/hosts, DNS)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in _NO_ADDRESS:
            return []
        raise
    return sorted({info[4][0] for info in infos})


def named_host(url: str) -> str | None:
    """The DNS name in `url`, or None where it gives an IP address."""
    host = urlsplit(url).hostname
    try:
        ipaddress.ip_address(host or "")
    except ValueError:
        return host
    return None


def _at(url: str, address: str) -> str:
    """`url` with its host replaced by `address` (its port kept)."""
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts._replace(netloc=f"{host}:{port}").geturl()


@dataclass(slots=True)
class Discovery:
    """Keeps each pool's backends equal to what its URLs resolve to."""
    pools: list[tuple[Pool, list[str]]]  # each pool with the URLs it was given
    every: float = 5.0  # seconds between resolutions
    resolve: Resolver = resolve
    _found: dict[str, list[str]] = field(default_factory=dict)  # URL -> backend URLs

    async def refresh(self) -> None:
        for pool, urls in self.pools:
            found = await asyncio.gather(*(self._expand(u) for u in urls))
            backends = sorted({b for group in found for b in group})
            added, removed = pool.update(backends)
            if added or removed:
                log.info("%s backends: %d (joined: %s; left: %s)", pool.name, len(backends),
                         " ".join(added) or "none", " ".join(removed) or "none")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            await self.refresh()

    async def _expand(self, url: str) -> list[str]:
        host = named_host(url)
        if host is None:
            return [url]
        try:
            addresses = await self.resolve(host, urlsplit(url).port or 80)
        except OSError as e:  # a resolver that fails now may answer next time
            log.warning("cannot resolve %s (%s); keeping its %d backends", host, e,
                        len(self._found.get(url, [])))
            return self._found.get(url, [])
        self._found[url] = [_at(url, a) for a in addresses]
        return self._found[url]
