"""The contracts of the egress side, in one place: relay ↔ upstream front ↔ pool ↔ connection.

Each boundary is a `typing.Protocol`, checked structurally by mypy (`make typecheck`, run by
`make test`), so a renamed method or a changed signature on either side fails the build
instead of failing at run time. Reading top down:

* `Client`: one client request as egress sees it (implemented by `relay.Exchange`, and by the
  warm-up request of each connection). Egress reads what to send, reports what the upstream
  answers, and points the client at its current `CallHandle`.
* `CallHandle`: one try (attempt) at sending that request (implemented by `UpstreamCall`). A client
  request may see several, one after another, on the same or different upstreams; the client
  only ever talks to the current one (to cancel it or to return withheld flow-control credit).
* `Carrier`: what an attempt needs of the connection carrying it (both connection kinds).
* `Egress`: what the worker needs of one upstream (`upstream.Upstream`, `httpx_pool.HttpxPool`).
* `Pool`: an HTTP/2 or HTTP/1.1 pool behind an `Upstream` (`h2pool.H2Pool`, `h1pool.H1Pool`).
* `Front`: what a pool needs of its `Upstream` (retries, the TLS contexts, the counters).

And the records they pass: `UpstreamCall`, egress's own record of one send of a client request
(which connection and stream carry it, its number among the tries, its deadline, when it was
sent and when the response headers came, the flow-control credit it withholds while its client
is not reading), and `Tally`, the per-upstream event counts. A client request knows only its
current attempt; when an attempt is abandoned (cancelled, refused, caught by a GOAWAY) and the
request is sent again, a new UpstreamCall is made for the same client, on any connection of any
pool. Withheld credit is bounded by construction: it grows only while the attempt is open on
its connection (`conn` is set), and the connection's single release point for a stream (H2:
`H2Connection._release`, H1: `H1Connection._release`) gives it back, whatever ended the attempt
(end of response, reset, GOAWAY, cancel, deadline, connection loss).

What a connection needs of its pool (`H2Owner`, `H1Owner`) is declared by each connection
module itself (h2conn, h1conn), which this module therefore never imports.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from velox.core.fields import F

if TYPE_CHECKING:
    from velox.config.tables import UpstreamSpec
    from velox.state.stats import Counters

Headers = list[tuple[bytes, bytes]]


class CallHandle(Protocol):
    """The client's view of the attempt currently carrying its request."""

    @property
    def t_sent(self) -> int:
        """perf_counter_ns() when the request was handed to the transport (0: not yet)."""

    @property
    def t_headers(self) -> int:
        """perf_counter_ns() when the response headers arrived (0: not yet)."""

    def cancel(self) -> None:
        """The client left: drop the request wherever it is (queue, stream, connection)."""

    def resume(self) -> None:
        """The client reads again: return the flow-control credit withheld while it did not."""


class Client(Protocol):
    """One client request, as egress sees it (relay.Exchange; a connection's warm-up)."""

    attempt: CallHandle | None  # set by egress to each new attempt; never cleared by it

    @property
    def method(self) -> bytes: ...

    @property
    def path(self) -> bytes:
        """The upstream request target."""

    @property
    def headers_out(self) -> Headers:
        """Upstream request headers: hop-by-hop dropped, credentials applied."""

    @property
    def body(self) -> bytes | bytearray | memoryview: ...

    @property
    def paused(self) -> bool:
        """The client is not reading: egress withholds flow-control credit until `resume`."""

    def on_response(self, status: int, headers: Headers, end_stream: bool) -> None: ...

    def on_data(self, data: bytes, end_stream: bool) -> None: ...

    def on_answer(self, status: int, headers: Headers, body: bytes) -> None:
        """The whole response at once (HTTP/2: its headers and the DATA frame ending it came
        in one read): the same as on_response(status, headers, False) then on_data(body,
        True), except that after on_response has moved the request elsewhere (a retry) or
        ended it, the body is not delivered."""

    def on_error(self, exc: BaseException) -> None:
        """The request failed (exc is a VeloxError); at most once, never after the end."""


class Carrier(Protocol):
    """A connection as the attempt on it sees it (h2conn.H2Connection, h1conn.H1Connection)."""

    def cancel(self, attempt: UpstreamCall) -> None:
        """End the attempt now (RST_STREAM on HTTP/2, close on HTTP/1.1), silently."""

    def credit(self, attempt: UpstreamCall) -> None:
        """Give back the credit the attempt withholds (its client is reading again)."""


class Egress(Protocol):
    """One upstream as the worker sees it."""

    @property
    def ready(self) -> bool:
        """Warm: a request submitted now is sent without waiting for a connection."""

    @property
    def open_connections(self) -> int: ...

    def start(self) -> None: ...

    def submit(self, client: Client, number: int = 0) -> None:
        """Make the client's next attempt (its `number`-th try, counted across upstreams) and
        send it now if a connection has room, else queue it; never raises. What is sent goes
        out with the next `flush`, which the caller makes after its submits. To move a request
        to another upstream: cancel its current attempt, then submit it there."""

    def flush(self) -> None:
        """Write what the batch encoded (called once after every micro-batch)."""

    def describe(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class Pool(Protocol):
    """An HTTP/2 or an HTTP/1.1 pool of one upstream, behind `upstream.Upstream`."""

    protocol: str  # "h2" | "http1"

    @property
    def ready(self) -> bool: ...

    @property
    def open_connections(self) -> int: ...

    def start(self) -> None: ...

    def dispatch(self, attempt: UpstreamCall) -> None:
        """Send the attempt on a connection with room, else queue it (or fail it: overloaded)."""

    def flush(self) -> None: ...

    def take_waiting(self) -> list[UpstreamCall]:
        """Hand over the queued attempts (the upstream is switching pools)."""

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None:
        """Close every connection and fail what is queued; stop the timers."""


class Front(Protocol):
    """What a pool needs of the `Upstream` it serves."""

    @property
    def spec(self) -> UpstreamSpec: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def tally(self) -> Tally: ...

    @property
    def closing(self) -> bool: ...

    def retry(self, attempt: UpstreamCall) -> bool:
        """Re-send a request the upstream provably did not process; False: fail it instead."""

    def tls(self, alpn: tuple[str, ...]) -> ssl.SSLContext: ...

    def on_no_h2(self) -> None:
        """ALPN chose HTTP/1.1: switch this upstream to an HTTP/1.1 pool (once)."""


# Tries per client request inside one upstream: a request the upstream provably did not process
# may be re-sent; this bounds the loop if the upstream keeps refusing.
MAX_ATTEMPTS = 5


class UpstreamCall:
    """One send of one client request; slotted, one per try (the only per-request egress object)."""

    __slots__ = ("client", "conn", "queue", "stream_id", "number", "deadline",
                 "t_sent", "t_headers", "last_activity", "withheld")

    def __init__(self, client: Client, number: int, deadline: float) -> None:
        self.client = client
        self.conn: Carrier | None = None  # set while a connection carries it
        self.queue: deque[UpstreamCall] | None = None  # set while it waits for a connection
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
        return f"<UpstreamCall #{self.number} {where} withheld={self.withheld}>"


class Tally:
    """Per-upstream event counts, mirrored into the shared stats slot of this worker (if any)."""

    __slots__ = ("counters", "slot", "goaways", "reconnects", "retries", "streams_cancelled",
                 "connect_failures", "warmup_timeouts", "ping_timeouts", "timeout_retirements",
                 "pipelined")

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
        self.pipelined = 0  # HTTP/1.1 requests written behind another on one connection

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

    def timer_wake(self) -> None:
        """A pool's sweep ran (what wakes an idle worker: /stats timer_wakes)."""
        self._add(F.TIMER_WAKES)

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
                "timeout_retirements": self.timeout_retirements, "pipelined": self.pipelined}
