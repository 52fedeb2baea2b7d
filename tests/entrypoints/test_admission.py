"""Admission bookkeeping: the queue bound, draining, tickets and their metrics."""

from __future__ import annotations

from prometheus_client import generate_latest

from pdserve.entrypoints.admission import Admission, Ticket


def _sample(adm: Admission, name: str, reason: str | None = None) -> float:
    value = adm.registry.get_sample_value(name, {"reason": reason} if reason else {})
    return value or 0.0


def test_admits_running_plus_queue_then_refuses_with_429():
    adm = Admission(max_running=2, max_queue=1)
    tickets = [adm.admit() for _ in range(3)]
    assert all(isinstance(t, Ticket) for t in tickets)
    status, message = adm.admit()
    assert status == 429 and "--max-queue 1" in message
    assert _sample(adm, "pdserve_requests_rejected_total", "queue_full") == 1
    tickets[0].release()
    tickets[0].release()  # idempotent: a second exit path must not free a second slot
    assert adm.in_flight == 2 and _sample(adm, "pdserve_requests_in_flight") == 2
    assert isinstance(adm.admit(), Ticket)
    assert isinstance(adm.admit(), tuple)


def test_no_queue_bound_by_default():
    adm = Admission(max_running=1)
    assert all(isinstance(adm.admit(), Ticket) for _ in range(100))


def test_max_queue_zero_admits_only_what_runs():
    adm = Admission(max_running=2, max_queue=0)
    assert [isinstance(adm.admit(), Ticket) for _ in range(3)] == [True, True, False]


def test_draining_refuses_everything_with_503():
    adm = Admission(max_running=4)
    held = adm.admit()
    adm.draining = True
    status, message = adm.admit()
    assert status == 503 and "shutting down" in message
    assert _sample(adm, "pdserve_requests_rejected_total", "draining") == 1
    held.release()
    assert adm.in_flight == 0
    assert b"pdserve_request_timeouts_total" in generate_latest(adm.registry)
