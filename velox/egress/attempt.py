"""One try at carrying a client request upstream, and the counters egress keeps per upstream.

An `Attempt` is egress's own record of one send: which connection and stream carry it, its
number among the tries of the same client request, its deadline, when it was sent and when the
response headers came, and the flow-control credit it withholds while its client is not
reading. The client request (relay.Exchange) knows only its current attempt; when an attempt is
abandoned (cancelled, refused, caught by a GOAWAY) and the request is sent again, a new Attempt
is made for the same client, on any connection of any pool.

Withheld credit is bounded by construction: it grows only while the attempt is open on its
connection (`conn` is set), and the connection's single release point for a stream (H2:
`H2Connection._release`, H1: `H1Connection._release`) gives it back, whatever ended the attempt
(end of response, reset, GOAWAY, cancel, deadline, connection loss).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from velox.state.stats import F

if TYPE_CHECKING:
    from velox._native import Counters
    from velox.egress.interfaces import Carrier, Client

# Tries per client request inside one upstream: a request the upstream provably did not process
# may be re-sent; this bounds the loop if the upstream keeps refusing.
MAX_ATTEMPTS = 5


class Attempt:
    """One send of one client request; slotted, one per try (the only per-request egress object)."""

    __slots__ = ("client", "conn", "queue", "stream_id", "number", "deadline",
                 "t_sent", "t_headers", "last_activity", "withheld")

    def __init__(self, client: Client, number: int, deadline: float) -> None:
        self.client = client
        self.conn: Carrier | None = None  # set while a connection carries it
        self.queue: deque[Attempt] | None = None  # set while it waits for a connection
        self.stream_id = 0
        self.number = number  # 0 for the first try
        self.deadline = deadline  # time.monotonic() by which the response headers must come
        self.t_sent = 0
        self.t_headers = 0
        self.last_activity = 0.0  # time.monotonic() of the last response bytes
        self.withheld = 0  # flow-controlled bytes received but not credited back yet

    def cancel(self) -> None:
        conn = self.conn
        if conn is not None:
            conn.cancel(self)
        elif self.queue is not None:
            try:
                self.queue.remove(self)
            except ValueError:
                pass
            self.queue = None

    def resume(self) -> None:
        conn = self.conn
        if conn is not None and self.withheld:
            conn.credit(self)

    def __repr__(self) -> str:
        where = "queued" if self.queue is not None else f"stream {self.stream_id}" \
            if self.conn is not None else "ended"
        return f"<Attempt #{self.number} {where} withheld={self.withheld}>"


class Tally:
    """Per-upstream event counts, mirrored into the shared stats slot of this worker (if any)."""

    __slots__ = ("counters", "slot", "goaways", "reconnects", "retries", "streams_cancelled",
                 "connect_failures", "warmup_timeouts", "ping_timeouts", "timeout_retirements")

    def __init__(self, counters: Counters | None = None, slot: int = 0) -> None:
        self.counters = counters
        self.slot = slot
        self.goaways = 0
        self.reconnects = 0
        self.retries = 0
        self.streams_cancelled = 0
        self.connect_failures = 0  # /stats only: not a shared counter
        self.warmup_timeouts = 0  # warm-ups unanswered within the connect timeout
        self.ping_timeouts = 0  # connections replaced for leaving a PING unanswered
        self.timeout_retirements = 0  # connections retired after request timeouts in a row

    def goaway(self) -> None:
        self.goaways += 1
        self._add(F.GOAWAYS)

    def reconnect(self) -> None:
        self.reconnects += 1
        self._add(F.RECONNECTS)

    def retry(self) -> None:
        self.retries += 1
        self._add(F.RETRIES)

    def cancelled(self) -> None:
        self.streams_cancelled += 1
        self._add(F.STREAMS_CANCELLED)

    def warmup_timeout(self) -> None:
        self.warmup_timeouts += 1
        self._add(F.UPSTREAM_WARMUP_TIMEOUTS)

    def ping_timeout(self) -> None:
        self.ping_timeouts += 1
        self._add(F.UPSTREAM_PING_TIMEOUTS)

    def timeout_retirement(self) -> None:
        self.timeout_retirements += 1
        self._add(F.UPSTREAM_TIMEOUT_RETIREMENTS)

    def _add(self, field: F) -> None:
        if self.counters is not None:
            self.counters.add(self.slot, field, 1)

    def as_dict(self) -> dict[str, int]:
        return {"goaways": self.goaways, "reconnects": self.reconnects, "retries": self.retries,
                "streams_cancelled": self.streams_cancelled,
                "connect_failures": self.connect_failures,
                "warmup_timeouts": self.warmup_timeouts, "ping_timeouts": self.ping_timeouts,
                "timeout_retirements": self.timeout_retirements}
