"""Ports for the servers benchmarks and tests start: below the ephemeral range, never twice."""

import socket

from pdserve.bench import launch
from pdserve.bench.launch import _ephemeral_low, free_port


def test_ports_are_free_below_the_ephemeral_range_and_never_handed_out_twice():
    low = _ephemeral_low()
    bases = [free_port(count=2) for _ in range(200)]
    ports = [b + i for b in bases for i in range(2)]
    assert len(set(ports)) == len(ports)  # no overlap between any two answers
    if low > 20002:
        assert all(10000 <= p < low for p in ports)


def test_a_bound_port_is_not_offered(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        fallback = free_port()
        launch._GIVEN.discard(fallback)
        picks = iter([taken, fallback])
        monkeypatch.setattr(launch.random, "randrange", lambda *_: next(picks))
        assert free_port() == fallback
