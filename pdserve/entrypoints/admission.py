"""Who gets in: a bounded queue (429 beyond it) and draining (503), counted in metrics.

The server counts the requests it has admitted and not yet answered. At most
`max_running` of them run (max_num_seqs per engine rank); `max_queue` more may wait. The
count is kept here, in the server, so that a burst is refused at once and exactly, without
asking engine ranks in other processes."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge


@dataclass(slots=True)
class Ticket:
    """One admitted request; release() is idempotent (called from several exits)."""
    admission: Admission
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.in_flight -= 1
            self.admission.in_flight_gauge.set(self.admission.in_flight)


@dataclass(slots=True)
class Admission:
    max_running: int = 64
    max_queue: int | None = None  # None: no limit
    draining: bool = False
    in_flight: int = 0
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    rejected: Counter = field(init=False)
    timeouts: Counter = field(init=False)
    in_flight_gauge: Gauge = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.rejected = Counter("pdserve_requests_rejected", "Requests refused at admission "
                                "(reason: queue_full 429, draining 503)", ["reason"], registry=r)
        self.timeouts = Counter("pdserve_request_timeouts", "Requests aborted at their time "
                                "limit", registry=r)
        self.in_flight_gauge = Gauge("pdserve_requests_in_flight",
                                     "Requests admitted and not yet answered", registry=r)

    def admit(self) -> Ticket | tuple[int, str]:
        """A ticket, or (status, message) saying why the request is refused."""
        if self.draining:
            self.rejected.labels("draining").inc()
            return 503, ("the server is shutting down (draining) and takes no new requests; "
                         "send this request to another instance")
        if self.max_queue is not None and self.in_flight >= self.max_running + self.max_queue:
            self.rejected.labels("queue_full").inc()
            return 429, (f"the server is at capacity ({self.max_running} requests running "
                         f"and {self.max_queue} waiting, --max-queue {self.max_queue}); "
                         "retry later")
        self.in_flight += 1
        self.in_flight_gauge.set(self.in_flight)
        return Ticket(self)
