"""Checks on kv_transfer_params a client sent, before the request reaches an engine."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

REMOTE_KEYS = ("remote_host", "remote_port", "remote_block_ids", "remote_engine_id")


def complete(p: dict[str, Any]) -> bool:
    """Enough to pull from a prefill (anything less is recomputed locally)."""
    return all(p.get(k) is not None for k in REMOTE_KEYS)


@dataclass(slots=True, frozen=True)
class ParamsValidator:
    block_size: int
    vocab_size: int
    allowed_hosts: frozenset[str]
    is_consumer: bool

    def host_allowed(self, host: str) -> bool:
        if host in self.allowed_hosts or host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def __call__(self, p: dict[str, Any], prompt_len: int) -> None:
        """Refuse params that are malformed or point where we must not go (ValueError)."""
        for key in ("do_remote_decode", "do_remote_prefill"):
            if key in p and not isinstance(p[key], bool):
                raise ValueError(f"{key} must be a boolean")
        if not p.get("do_remote_prefill"):
            return
        if p.get("do_remote_decode"):
            raise ValueError("do_remote_prefill and do_remote_decode are exclusive")
        if not self.is_consumer:
            raise ValueError("this server is a KV producer (kv_role kv_producer); it does "
                             "not pull KV")
        if not complete(p):
            return  # merely unusable: the prompt is recomputed here
        self._check_remote(p, prompt_len)

    def _check_remote(self, p: dict[str, Any], prompt_len: int) -> None:
        host, port, ids = p["remote_host"], p["remote_port"], p["remote_block_ids"]
        if not isinstance(host, str) or not self.host_allowed(host):
            raise ValueError(f"remote_host {host!r} is not allowed (allowed: loopback, "
                             f"{', '.join(sorted(self.allowed_hosts))}; see "
                             "kv_connector_extra_config.allowed_remote_hosts)")
        if not _is_int(port) or not 0 < port < 65536:
            raise ValueError("remote_port must be an integer in 1..65535")
        if not isinstance(ids, list) or not all(_is_int(b) and b >= 0 for b in ids):
            raise ValueError("remote_block_ids must be a list of non-negative integers")
        need = -(-prompt_len // self.block_size)
        if len(ids) != need:
            raise ValueError(f"remote_block_ids has {len(ids)} blocks; a {prompt_len}-token "
                             f"prompt fills {need}")
        if not isinstance(p["remote_engine_id"], str) or \
                not isinstance(p.get("remote_request_id", ""), str):
            raise ValueError("remote_engine_id and remote_request_id must be strings")
        first = p.get("first_token_id")
        if first is not None and (not _is_int(first) or not 0 <= first < self.vocab_size):
            raise ValueError("first_token_id must be a token id of this model")
        top = p.get("first_token_top_logprobs")
        if top is not None and not (isinstance(top, list) and all(
                isinstance(e, list) and len(e) == 2 and _is_int(e[0])
                and 0 <= e[0] < self.vocab_size and isinstance(e[1], int | float)
                and not isinstance(e[1], bool) for e in top)):
            raise ValueError("first_token_top_logprobs must be a list of [token id, logprob] "
                             "pairs")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
