"""`kv_transfer_params` (vLLM's HTTP protocol) as a typed value: parsed and checked once, when
a request arrives, then read by name wherever it goes."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, fields
from typing import Any

from pdserve.config import KVTransferConfig

REMOTE_KEYS = ("remote_host", "remote_port", "remote_block_ids", "remote_engine_id")
TopLogprobs = list[tuple[int, float]]  # one position's most likely (token id, logprob)


@dataclass(slots=True)
class PromptLogprob:
    """A prompt token's logprob given the tokens before it, its rank in the vocabulary (1:
    the likeliest; vLLM's, counting the tokens at least as likely) and the k likeliest."""
    logprob: float
    rank: int
    top: TopLogprobs = field(default_factory=list)


@dataclass(slots=True)
class FirstToken:
    """What a prefill computed that its decode cannot: the token it sampled and, when
    asked, the prompt's logprobs (prompt tokens 1.. ; the first has none). Handed to the
    decode with the KV."""
    token_id: int
    logprob: float
    top_logprobs: TopLogprobs = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None


@dataclass(slots=True)
class KVParams:
    do_remote_decode: bool = False  # to a prefill: hold the KV for a remote decode
    do_remote_prefill: bool = False  # to a decode: pull the prompt's KV from a prefill
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int | None = None
    first_token_id: int | None = None
    first_token_logprob: float | None = None
    first_token_top_logprobs: TopLogprobs | None = None
    # pdserve's: a prefill's prompt logprobs, as [logprob, rank, [[token id, logprob], ...]]
    prompt_logprobs: list[PromptLogprob] | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVParams:
        """Parse a client's params; ValueError names the malformed key. Keys this server
        does not know are ignored (vLLM sends more), and so are nulls."""
        p = cls(**{f.name: raw[f.name] for f in fields(cls) if raw.get(f.name) is not None})
        p._check_types()
        if p.first_token_top_logprobs is not None:
            p.first_token_top_logprobs = _pairs(p.first_token_top_logprobs)
        if p.prompt_logprobs is not None:
            p.prompt_logprobs = [PromptLogprob(float(lp), rank, _pairs(top))
                                 for lp, rank, top in p.prompt_logprobs]
        return p

    @classmethod
    def for_decode(cls, engine_id: str, host: str, port: int, request_id: str,
                   block_ids: list[int], tp_size: int, first: FirstToken) -> KVParams:
        """A prefill's answer: where a decode finds the prompt's KV, and the first token."""
        return cls(do_remote_prefill=True, remote_engine_id=engine_id,
                   remote_block_ids=list(block_ids), remote_request_id=request_id,
                   remote_host=host, remote_port=port, tp_size=tp_size,
                   first_token_id=first.token_id, first_token_logprob=first.logprob,
                   first_token_top_logprobs=first.top_logprobs or None,
                   prompt_logprobs=first.prompt_logprobs)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}
        if self.first_token_top_logprobs is not None:
            d["first_token_top_logprobs"] = [[t, lp] for t, lp in self.first_token_top_logprobs]
        if self.prompt_logprobs is not None:
            d["prompt_logprobs"] = [[e.logprob, e.rank, [[t, lp] for t, lp in e.top]]
                                    for e in self.prompt_logprobs]
        return d

    @property
    def complete(self) -> bool:
        """Enough to pull from a prefill (anything less is recomputed locally)."""
        return all(getattr(self, k) is not None for k in REMOTE_KEYS)

    @property
    def pulls(self) -> bool:
        """A decode is to pull this request's prompt KV (else it recomputes it)."""
        return self.do_remote_prefill and self.complete

    @property
    def first_token(self) -> FirstToken | None:
        if self.first_token_id is None:
            return None
        return FirstToken(self.first_token_id, float(self.first_token_logprob or 0.0),
                          list(self.first_token_top_logprobs or []), self.prompt_logprobs)

    def _check_types(self) -> None:
        for key in ("do_remote_decode", "do_remote_prefill"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be a boolean")
        for key in ("remote_engine_id", "remote_request_id", "remote_host"):
            if not isinstance(getattr(self, key), str | None):
                raise ValueError(f"{key} must be a string")
        for key in ("remote_port", "tp_size", "first_token_id"):
            if not isinstance(v := getattr(self, key), int | None) or isinstance(v, bool):
                raise ValueError(f"{key} must be an integer")
        ids = self.remote_block_ids
        if ids is not None and not (isinstance(ids, list) and all(
                _is_int(b) and b >= 0 for b in ids)):
            raise ValueError("remote_block_ids must be a list of non-negative integers")
        if not isinstance(lp := self.first_token_logprob, int | float | None) or \
                isinstance(lp, bool):
            raise ValueError("first_token_logprob must be a number")
        top = self.first_token_top_logprobs
        if top is not None and not _is_pairs(top):
            raise ValueError("first_token_top_logprobs must be a list of [token id, logprob] "
                             "pairs")
        prompt = self.prompt_logprobs
        if prompt is not None and not (isinstance(prompt, list) and all(
                isinstance(e, list | tuple) and len(e) == 3 and _is_number(e[0])
                and _is_int(e[1]) and _is_pairs(e[2]) for e in prompt)):
            raise ValueError("prompt_logprobs must be a list of [logprob, rank, [[token id, "
                             "logprob], ...]]")


@dataclass(slots=True, frozen=True)
class ParamsValidator:
    """What this server accepts of a client's params, beyond their types."""
    block_size: int
    vocab_size: int
    allowed_hosts: frozenset[str]
    is_consumer: bool
    # Networks named in allowed_remote_hosts (a Kubernetes pod network: pods' addresses
    # are not known in advance).
    allowed_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def of(cls, kv: KVTransferConfig, block_size: int, vocab_size: int,
           side_channel_host: str) -> ParamsValidator:
        extra = kv.kv_connector_extra_config.allowed_remote_hosts
        allowed = frozenset({side_channel_host, *(h for h in extra if "/" not in h)})
        networks = tuple(ipaddress.ip_network(h, strict=False) for h in extra if "/" in h)
        return cls(block_size, vocab_size, allowed, kv.is_consumer, networks)

    def host_allowed(self, host: str) -> bool:
        if host in self.allowed_hosts or host == "localhost":
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return address.is_loopback or any(address in n for n in self.allowed_networks)

    def __call__(self, p: KVParams, prompt_len: int) -> None:
        """Refuse params that contradict themselves or point where we must not go
        (ValueError)."""
        if not p.do_remote_prefill:
            return
        if p.do_remote_decode:
            raise ValueError("do_remote_prefill and do_remote_decode are exclusive")
        if not self.is_consumer:
            raise ValueError("this server is a KV producer (kv_role kv_producer); it does "
                             "not pull KV")
        if p.complete:  # anything less is merely unusable: the prompt is recomputed here
            self._check_remote(p, prompt_len)

    def _check_remote(self, p: KVParams, prompt_len: int) -> None:
        if not self.host_allowed(p.remote_host):
            raise ValueError(f"remote_host {p.remote_host!r} is not allowed (allowed: "
                             f"loopback, {', '.join(sorted(self.allowed_hosts))}; see "
                             "kv_connector_extra_config.allowed_remote_hosts)")
        if not 0 < p.remote_port < 65536:
            raise ValueError("remote_port must be an integer in 1..65535")
        # A prefill's blocks may be k times smaller than ours (the handshake tells k).
        fits = {-(-prompt_len // b) for b in range(1, self.block_size + 1)
                if self.block_size % b == 0}
        n, ours = len(p.remote_block_ids), -(-prompt_len // self.block_size)
        if n < ours:
            raise ValueError(f"remote_block_ids has {n} blocks for a {prompt_len}-token "
                             f"prompt: the prefill's blocks are larger than this server's "
                             f"{self.block_size} tokens, and a decode's --block-size must be "
                             "a multiple of the prefill's")
        if n not in fits:
            raise ValueError(f"remote_block_ids has {n} blocks; a {prompt_len}-token prompt "
                             f"fills {ours} blocks of {self.block_size} tokens (or of a "
                             "divisor of it)")
        first = p.first_token_id
        if first is not None and not 0 <= first < self.vocab_size:
            raise ValueError("first_token_id must be a token id of this model")
        if any(not 0 <= t < self.vocab_size for t, _ in p.first_token_top_logprobs or []):
            raise ValueError("first_token_top_logprobs must be a list of [token id, logprob] "
                             "pairs")
        if p.prompt_logprobs is not None:  # one per prompt token after the first
            if len(p.prompt_logprobs) != prompt_len - 1:
                raise ValueError(f"prompt_logprobs has {len(p.prompt_logprobs)} entries for a "
                                 f"{prompt_len}-token prompt (one per token after the first)")
            if any(not 0 <= t < self.vocab_size for e in p.prompt_logprobs for t, _ in e.top):
                raise ValueError("prompt_logprobs must name token ids of this model")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_pairs(v: object) -> bool:
    """A list of [token id, logprob] pairs (JSON's form of TopLogprobs)."""
    return isinstance(v, list) and all(isinstance(e, list | tuple) and len(e) == 2
                                       and _is_int(e[0]) and _is_number(e[1]) for e in v)


def _pairs(v: list) -> TopLogprobs:
    return [(int(t), float(lp)) for t, lp in v]
