"""The proxy's routing decisions as bookkeeping (the e2e twin is tests/e2e/test_proxy.py):
policies' orders, the prefix policy's affinity and load fallback, when to prefill locally,
and prompt token counts equal to the server's."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pdserve.entrypoints import routing
from pdserve.entrypoints.routing import Backend, Disaggregation, Pool, PromptTokens, prefix_key


def _pool(policy: str, n: int = 3, name: str = "prefill", **kw) -> Pool:
    return Pool(name, [Backend(f"http://b{i}") for i in range(n)], policy, **kw)


def _urls(backends: list[Backend]) -> list[str]:
    return [b.url for b in backends]


def test_round_robin_rotates_and_least_loaded_sorts():
    pool = _pool("round_robin")
    firsts = [pool.order()[0][0].url for _ in range(4)]
    assert firsts == ["http://b0", "http://b1", "http://b2", "http://b0"]
    pool = _pool("least_loaded")
    for b, load in zip(pool.backends, (3, 0, 1), strict=True):
        b.outstanding = load
    assert _urls(pool.order()[0]) == ["http://b1", "http://b2", "http://b0"]


def test_prefix_policy_is_sticky_spreads_and_falls_back_when_busy():
    pool = _pool("prefix", max_imbalance=2)
    keys = [prefix_key([i, 7, 7, 7], 64) for i in range(40)]
    homes = [pool.order(k)[0][0] for k in keys]
    assert all(pool.order(k)[0][0] is h for k, h in zip(keys, homes, strict=True))
    assert len({h.url for h in homes}) == 3  # 40 prefixes use every backend
    key, home = keys[0], homes[0]
    home.outstanding = 2  # within the allowed imbalance: stay
    assert pool.order(key) == ([home, *(b for b in pool.backends if b is not home)], False)
    home.outstanding = 3  # too busy: least loaded first, and say so
    order, fell_back = pool.order(key)
    assert fell_back and order[-1] is home and order[0].outstanding == 0
    # No key (an unreadable body): least loaded.
    assert pool.order(None) == (order, False)


_blocks = routing.Residency.blocks


def test_residency_finds_the_decode_holding_a_conversations_history():
    pool = _pool("round_robin", name="decode")
    where = routing.Residency()
    turn1 = list(range(100))  # 6 full blocks of 16
    where.sent(pool.backends[2], _blocks(turn1))
    turn2 = turn1 + list(range(500, 620))  # + the answer and a new message
    assert where.find(_blocks(turn2), pool) == (pool.backends[2], 96)
    assert where.find(_blocks(list(range(1, 100))), pool) == (None, 0)  # another start
    where.sent(pool.backends[0], _blocks(turn1[:40]))  # two full blocks there too
    pool.backends[2].outstanding = 5
    assert where.find(_blocks(turn1[:40]), pool) == (pool.backends[0], 32)  # tie: the less loaded
    assert where.find(_blocks(turn2), pool) == (pool.backends[2], 96)  # the longer one wins


def test_residency_forgets_the_least_recently_sent():
    pool = _pool("round_robin", name="decode")
    where = routing.Residency(capacity=4)
    first, second = list(range(64)), list(range(1000, 1064))
    where.sent(pool.backends[0], _blocks(first))
    where.sent(pool.backends[1], _blocks(second))
    assert where.find(_blocks(first), pool) == (None, 0)
    assert where.find(_blocks(second), pool) == \
        (pool.backends[1], 4 * routing.RESIDENT_BLOCK)


def test_a_preferred_backend_goes_first_while_load_allows():
    pool = _pool("least_loaded", max_imbalance=2)
    home = pool.backends[2]
    home.outstanding = 2
    assert pool.order(None, prefer=home)[0][0] is home
    home.outstanding = 3
    assert pool.order(None, prefer=home)[0][0] is not home


def test_prefix_key_is_the_leading_tokens():
    assert prefix_key([1, 2, 3], 2) == prefix_key([1, 2, 9], 2) != prefix_key([1, 3], 2)
    assert prefix_key([], 4) is None and prefix_key(None, 4) is None
    assert prefix_key([-1, 2**70], 4) != prefix_key([1, 2**70], 4)  # the backend refuses


def test_local_prefill_by_length_and_by_queue():
    pool, decodes = _pool("round_robin", n=2), _pool("round_robin", n=1)
    d = Disaggregation(local_prefill_below=10, max_prefill_queue=1)
    assert d.local_reason(9, pool, decodes) == "short_prompt"
    assert d.local_reason(10, pool, decodes) is None
    assert d.local_reason(None, pool, decodes) is None
    pool.backends[0].outstanding = 2
    assert d.local_reason(50, pool, decodes) is None  # one prefill still has room
    pool.backends[1].reported_waiting = 2  # other clients' queue, seen in its /metrics
    assert d.local_reason(50, pool, decodes) == "prefill_busy"
    pool.backends[0].outstanding = 0
    assert d.local_reason(50, pool, decodes) is None
    pool.backends[0].mark(reachable=False)  # room there, but it is down: does not count
    assert d.local_reason(50, pool, decodes) == "prefill_busy"
    pool.backends[1].mark(reachable=False)
    assert d.local_reason(50, pool, decodes) == "prefill_down"
    assert Disaggregation().local_reason(1, pool, decodes) is None  # off by default


def test_overflow_stops_while_the_decodes_prefill_as_many_themselves():
    """Under a burst both tiers prefill: a decode already prefilling k prompts of its own
    takes another only while every prefill holds more than N + k."""
    prefills, decodes = _pool("round_robin", n=1), _pool("round_robin", n=2)
    d = Disaggregation(max_prefill_queue=2)
    prefills.backends[0].outstanding = 4
    decodes.backends[0].local_prefills = 1
    assert d.local_reason(50, prefills, decodes) == "prefill_busy"  # decode 1 has none
    decodes.backends[1].local_prefills = 2
    assert d.local_reason(50, prefills, decodes) == "prefill_busy"  # 4 > 2 + 1
    decodes.backends[0].local_prefills = 2
    assert d.local_reason(50, prefills, decodes) is None  # 4 is not > 2 + 2
    decodes.backends[0].mark(reachable=False)  # only decode 1 counts, with 2 of its own
    assert d.local_reason(50, prefills, decodes) is None
    prefills.backends[0].outstanding = 5
    assert d.local_reason(50, prefills, decodes) == "prefill_busy"


@pytest.fixture(scope="module")
def counter() -> PromptTokens:
    return PromptTokens(None)


def test_prompt_tokens_as_the_server_counts_them(counter, tokenizer):
    text = "The capital of France is"
    assert counter("/v1/completions", {"prompt": text}) == tokenizer.encode(text)
    assert counter("/v1/completions", {"prompt": [[5, 6, 7]]}) == [5, 6, 7]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    want = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]))
    assert counter("/v1/chat/completions", {"messages": msgs}) == want
    # What the backend will refuse is not counted (it routes by default, and the backend
    # answers with its message).
    for path, body in [("/v1/completions", {"prompt": ""}), ("/v1/completions", {}),
                       ("/v1/chat/completions", {"messages": []}),
                       ("/v1/completions", {"prompt": "\ud800"})]:
        assert counter(path, body) is None, body


def test_unreachable_backends_are_tried_last_for_a_while():
    pool = _pool("round_robin")
    pool.backends[1].mark(reachable=False)
    assert _urls(pool.order()[0]) == ["http://b0", "http://b2", "http://b1"]
    pool.backends[1].mark(reachable=True)
    assert _urls(pool.order()[0]) == ["http://b1", "http://b2", "http://b0"]  # its turn


def test_up_passes_the_routing_flags_to_its_proxy():
    import argparse

    from pdserve.entrypoints import up

    sub = argparse.ArgumentParser().add_subparsers()
    up.add_parser(sub)
    args = sub.choices["up"].parse_args(["--policy", "prefix", "--local-prefill-below", "128",
                                         "--model", "/m/x.gguf"])
    proxy = up.plan(args, [])[-1].argv
    flags = " ".join(proxy[proxy.index("proxy"):])
    assert "--policy prefix" in flags and "--local-prefill-below 128" in flags
    assert f"--max-prefill-queue {up.UP_MAX_PREFILL_QUEUE}" in flags  # up's default
    assert "--tokenizer /m/x.gguf" in flags
    args = sub.choices["up"].parse_args(["--max-prefill-queue", "off"])
    proxy = up.plan(args, [])[-1].argv
    assert "--max-prefill-queue" not in proxy  # the proxy's default: never


def test_max_prefill_queue_takes_a_number_or_off(capsys):
    import argparse

    from pdserve.entrypoints import proxy_cli

    sub = argparse.ArgumentParser().add_subparsers()
    proxy_cli.add_parser(sub)
    parse = sub.choices["proxy"].parse_args
    base = ["--prefill", "http://p", "--decode", "http://d"]
    assert parse(base).max_prefill_queue is None  # off unless asked
    assert parse([*base, "--max-prefill-queue", "3"]).max_prefill_queue == 3
    assert parse([*base, "--max-prefill-queue", "off"]).max_prefill_queue is None
    with pytest.raises(SystemExit):
        parse([*base, "--max-prefill-queue", "lots"])
    assert "expected a number or 'off', not 'lots'" in capsys.readouterr().err


def test_a_prefill_that_answers_its_queue_poll_is_up_again():
    """A prefill that refused a request while starting gets prompts again once it answers
    the proxy's queue poll, not DOWN_SECONDS later."""
    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'pdserve_num_requests_waiting{model_name="m"} 3.0\n'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pool = Pool("prefill", [Backend(f"http://127.0.0.1:{server.server_port}")], "round_robin")
    pool.backends[0].mark(reachable=False)
    assert not pool.backends[0].up

    async def poll_once() -> None:
        async with httpx.AsyncClient() as client:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(routing.poll_queues(client, pool),
                                       routing.QUEUE_POLL_SECONDS / 2)
    try:
        asyncio.run(poll_once())
    finally:
        server.shutdown()
    assert pool.backends[0].up and pool.backends[0].reported_waiting == 3
