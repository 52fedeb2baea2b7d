"""How the proxy picks backends: per-tier policies (round robin, least loaded, prefix
affinity), where a prompt's history already is, and the choice between disaggregated and
local prefill."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.engine.block_allocator import chain_hashes
from pdserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest

POLICIES = ("round_robin", "least_loaded", "prefix")
QUEUE_POLL_SECONDS = 0.5
DOWN_SECONDS = 10.0  # a backend that refused a connection is tried last for this long
RESIDENT_BLOCK = 16  # tokens per block of the residency record (the engines' default)
RESIDENT_BLOCKS = 200_000  # blocks remembered (~3M tokens), least recently sent dropped


@dataclass(slots=True, eq=False)  # compared and hashed by identity: a pod that comes back
class Backend:                      # at the same address is a new backend (empty caches)
    url: str
    # What the prefix policy's hash ranks it by: among backends given on the command line
    # its position (a prefix's prefill and decode homes pair up), among discovered ones its
    # URL (every proxy replica agrees, whatever order it found them in).
    rank_key: bytes = b""
    outstanding: int = 0  # requests this proxy has sent and not yet finished
    reported_waiting: int = 0  # the backend's own pdserve_num_requests_waiting, polled
    local_prefills: int = 0  # a decode's: plain requests sent, first token not yet back
    down_until: float = 0.0  # monotonic time; set when it was unreachable

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    def unsent(self, local: bool) -> None:
        """A request counted in flight here did not get through."""
        self.outstanding -= 1
        self.local_prefills -= local

    def mark(self, reachable: bool) -> None:
        self.down_until = 0.0 if reachable else time.monotonic() + DOWN_SECONDS

    @property
    def queue(self) -> int:
        """Requests queued or in flight there: ours, or all clients' if it reports more."""
        return max(self.outstanding, self.reported_waiting)


@dataclass(slots=True)
class Pool:
    """Backends of one tier and the policy that picks among them."""
    name: str
    backends: list[Backend]
    policy: str = "round_robin"
    max_imbalance: int = 4  # prefix policy: how much busier than the idlest its home may be
    _turn: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        for i, b in enumerate(self.backends):
            b.rank_key = b.rank_key or i.to_bytes(4, "little")

    def update(self, urls: list[str]) -> tuple[list[str], list[str]]:
        """Make `urls` the pool's backends (discovery): those it had keep their state, the
        rest start afresh; returns the URLs added and removed. A new list, so a caller
        iterating the old one across an await is not disturbed."""
        known = {b.url: b for b in self.backends}
        self.backends = [known.get(u) or Backend(u, u.encode()) for u in urls]
        return [u for u in urls if u not in known], [u for u in known if u not in urls]

    def order(self, key: bytes | None = None, prefer: Backend | None = None
              ) -> tuple[list[Backend], bool]:
        """Backends in the order to try them, the policy's pick first (`prefer`, where a
        prompt's history is, before it while load allows) and those that were recently
        unreachable last; and whether the prefix policy left the prompt's home instance
        because it was too busy."""
        if not self.backends:  # discovery found none
            return [], False
        backends, fell_back = self._by_policy(key)
        if prefer is not None and prefer.outstanding - min(
                b.outstanding for b in self.backends) <= self.max_imbalance:
            backends = [prefer, *(b for b in backends if b is not prefer)]
        return sorted(backends, key=lambda b: not b.up), fell_back  # stable: keeps the pick

    def _by_policy(self, key: bytes | None) -> tuple[list[Backend], bool]:
        by_load = sorted(self.backends, key=lambda b: b.outstanding)
        if self.policy == "prefix" and key is not None:
            home = max(self.backends, key=lambda b: _score(key, b.rank_key))
            if home.outstanding - by_load[0].outstanding <= self.max_imbalance:
                return [home, *(b for b in by_load if b is not home)], False
            return by_load, True
        if self.policy in ("least_loaded", "prefix"):
            return by_load, False
        start = next(self._turn) % len(self.backends)
        return self.backends[start:] + self.backends[:start], False


def _score(key: bytes, rank_key: bytes) -> int:
    """Rendezvous hashing: each prefix ranks the backends in its own fixed order, so adding
    a backend moves only the prefixes it now wins."""
    digest = hashlib.blake2b(key + rank_key, digest_size=8).digest()
    return int.from_bytes(digest, "little")


def prefix_key(token_ids: list[int] | None, num_tokens: int) -> bytes | None:
    """The routing key of a prompt: its first `num_tokens` token ids."""
    if not token_ids:
        return None
    # As text: ids out of any range (the backend refuses them) must not fail here.
    return ",".join(map(str, token_ids[:num_tokens])).encode()


@dataclass(slots=True)
class Residency:
    """Which backends of a tier hold which prompt prefixes in their prefix caches, as far
    as this proxy sent them there. A conversation's next turn is its last prompt plus the
    answer plus a new message: sent where the last prompt went, only the new part is
    computed (the answer's KV is there too)."""
    capacity: int = RESIDENT_BLOCKS
    _where: OrderedDict[bytes, set[Backend]] = field(default_factory=OrderedDict)

    @staticmethod
    def blocks(tokens: list[int]) -> list[bytes]:
        """The chain hashes of a prompt's full blocks, by which it is recorded and found."""
        return chain_hashes(tokens, RESIDENT_BLOCK, [], len(tokens) // RESIDENT_BLOCK)

    def sent(self, backend: Backend, blocks: list[bytes]) -> None:
        """`backend` now holds the KV of these blocks."""
        for h in blocks:
            self._where.setdefault(h, set()).add(backend)
            self._where.move_to_end(h)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def find(self, blocks: list[bytes], pool: Pool) -> tuple[Backend | None, int]:
        """The backend holding the longest run of these blocks from the first (the least
        loaded of those that tie), and that run's length in tokens. Backends discovery
        dropped hold nothing."""
        live = set(pool.backends)
        holders: set[Backend] | None = None
        depth = 0
        for h in blocks:
            found = self._where.get(h, set()) & live
            common = found if holders is None else holders & found
            if not common:
                break
            holders, depth = common, depth + 1
        if not depth:
            return None, 0
        best = min((b for b in pool.backends if b in holders), key=lambda b: b.outstanding)
        return best, depth * RESIDENT_BLOCK


@dataclass(slots=True)
class Disaggregation:
    """When to skip the prefill tier and let a decode instance prefill the prompt itself."""
    local_prefill_below: int | None = None  # prompt tokens
    max_prefill_queue: int | None = None

    def local_reason(self, num_tokens: int | None, prefill: Pool, decode: Pool
                     ) -> str | None:
        """Why this prompt should be prefilled on the decode, or None to disaggregate."""
        if self.local_prefill_below is not None and num_tokens is not None \
                and num_tokens < self.local_prefill_below:
            return "short_prompt"
        if self.max_prefill_queue is None:
            return None
        live = [b for b in prefill.backends if b.up]
        if not live:  # every prefill refused a connection just now: the decodes can serve
            return "prefill_down"
        # Overflow only while the prefills stay deeper than the decodes' own prefill queues:
        # under a burst both tiers prefill, neither left idle while the other has a queue.
        local = min((b.local_prefills for b in decode.backends if b.up), default=0)
        if all(b.queue > self.max_prefill_queue + local for b in live):
            return "prefill_busy"
        return None


class PromptTokens:
    """Token ids of a request's prompt, as the backends will count them: the served
    model's tokenizer and chat template, run here. No round trip to a backend, and it
    works in front of any OpenAI server (vLLM's /tokenize is not everywhere)."""

    def __init__(self, model: str | None) -> None:
        from pdserve.model.loader import resolve, tokenizer_folder  # imports torch
        from pdserve.model.tokenizer import Tokenizer

        # counting needs no eos
        self.tokenizer = Tokenizer.from_folder(tokenizer_folder(resolve(model)), [])

    def __call__(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """None where the body is not a valid request: the backend will say why."""
        try:
            if path.endswith("/chat/completions"):
                req = ChatCompletionRequest.model_validate(body)
                text = self.tokenizer.apply_chat_template(
                    [{"role": m.role, "content": m.text()} for m in req.messages])
            else:
                text = CompletionRequest.model_validate(body).single_prompt()
                if isinstance(text, list):
                    return text
            return self.tokenizer.encode(text)
        except Exception:  # pydantic, the template or `tokenizers` (bare Exceptions)
            return None


async def poll_queues(client: httpx.AsyncClient, pool: Pool) -> None:
    """Keep each prefill's own count of waiting requests fresh: other proxies' and
    clients' requests queue there too, which our outstanding count cannot see. A prefill
    that answers is up again: one that refused a request while (re)starting gets prompts
    within a poll of coming back, not DOWN_SECONDS later."""
    async def one(b: Backend) -> None:
        try:
            r = await client.get(b.url + "/metrics", timeout=2)
            b.reported_waiting = int(sum(map(float, _WAITING.findall(r.text))))
            if r.status_code == 200:
                b.mark(reachable=True)
        except (httpx.HTTPError, ValueError):
            b.reported_waiting = 0  # a prefill that is down is skipped when sent to
    while True:
        await asyncio.gather(*(one(b) for b in pool.backends))
        await asyncio.sleep(QUEUE_POLL_SECONDS)


_WAITING = re.compile(r"^pdserve_num_requests_waiting(?:\{[^}]*\})? (\S+)$", re.M)


def add_routing_args(p: argparse.ArgumentParser) -> None:
    """Routing flags, shared with `pdserve up` (which passes them to its proxy)."""
    p.add_argument("--policy", default="round_robin", choices=POLICIES,
                   help="prefix: prompts sharing their first --prefix-tokens tokens go to "
                        "the same prefill and decode while load allows")
    p.add_argument("--prefix-tokens", type=int, default=64)
    p.add_argument("--prefix-max-imbalance", type=int, default=4,
                   help="prefix policy: leave a prompt's home instance when it has more than "
                        "this many requests in flight beyond the idlest")
    p.add_argument("--local-prefill-below", type=int, default=None, metavar="N",
                   help="prompts under N tokens go straight to a decode, which prefills them; "
                        "counted beyond what the decode already holds (a conversation's "
                        "earlier turns), which is where such prompts go")
    p.add_argument("--max-prefill-queue", type=_queue_limit, default="off", metavar="N",
                   help="while every prefill has more than N requests queued or in flight "
                        "beyond those the decodes are prefilling themselves, send new ones "
                        "straight to a decode ('off': never; default: %(default)s)")
    p.add_argument("--tokenizer", default=None, help="the served model's HF folder or .gguf, "
                   "to count prompt tokens (default: the embedded model)")


def _queue_limit(value: str) -> int | None:
    if value == "off":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'off', not {value!r}") from None


def check_routing_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the routing flags, if anything."""
    for flag, value, least in (("--prefix-tokens", args.prefix_tokens, 1),
                               ("--local-prefill-below", args.local_prefill_below, 1),
                               ("--prefix-max-imbalance", args.prefix_max_imbalance, 0),
                               ("--max-prefill-queue", args.max_prefill_queue, 0)):
        if value is not None and value < least:
            return f"{flag} must be at least {least}, not {value}"
    return None


def routing_argv(args: argparse.Namespace) -> list[str]:
    """The routing flags given to `up`, for its proxy's command line (the tokenizer is
    that of `up --model` unless named)."""
    argv = []
    for name in ("policy", "prefix_tokens", "prefix_max_imbalance", "local_prefill_below",
                 "max_prefill_queue"):
        if (v := getattr(args, name)) is not None:
            argv += [f"--{name.replace('_', '-')}", str(v)]
    if tokenizer := args.tokenizer or args.model:
        argv += ["--tokenizer", tokenizer]
    return argv
