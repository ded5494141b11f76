"""The contracts of the egress side, in one place: relay ↔ upstream front ↔ pool ↔ connection.

Each boundary is a `typing.Protocol`, checked structurally by mypy (`make typecheck`, run by
`make test`), so a renamed method or a changed signature on either side fails the build
instead of failing at run time. Reading top down:

* `Client`: one client request as egress sees it (implemented by `relay.Exchange`, and by the
  warm-up request of each connection). Egress reads what to send, reports what the upstream
  answers, and points the client at its current `AttemptHandle`.
* `AttemptHandle`: one try at sending that request (implemented by `attempt.Attempt`). A client
  request may see several, one after another, on the same or different upstreams; the client
  only ever talks to the current one (to cancel it or to return withheld flow-control credit).
* `Carrier`: what an attempt needs of the connection carrying it (both connection kinds).
* `Egress`: what the worker needs of one upstream (`upstream.Upstream`, `httpx_pool.HttpxPool`).
* `Pool`: an HTTP/2 or HTTP/1.1 pool behind an `Upstream` (`h2pool.H2Pool`, `h1pool.H1Pool`).
* `Front`: what a pool needs of its `Upstream` (retries, the TLS contexts, the counters).
* `H2Owner` / `H1Owner`: what a connection needs of its pool.

Imports: stdlib only (attempt, the connections and tables for annotations, under TYPE_CHECKING).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sized
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from velox.egress.attempt import Attempt, Tally
    from velox.egress.h1conn import H1Connection
    from velox.egress.h2conn import H2Connection
    from velox.tables import UpstreamSpec

Headers = list[tuple[bytes, bytes]]


class AttemptHandle(Protocol):
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

    attempt: AttemptHandle | None  # set by egress to each new attempt; never cleared by it

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

    def cancel(self, attempt: Attempt) -> None:
        """End the attempt now (RST_STREAM on HTTP/2, close on HTTP/1.1), silently."""

    def credit(self, attempt: Attempt) -> None:
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
        send it now if a connection has room, else queue it; never raises. To move a request
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

    def dispatch(self, attempt: Attempt) -> None:
        """Send the attempt on a connection with room, else queue it (or fail it: overloaded)."""

    def flush(self) -> None: ...

    def take_waiting(self) -> list[Attempt]:
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

    def retry(self, attempt: Attempt) -> bool:
        """Re-send a request the upstream provably did not process; False: fail it instead."""

    def tls(self, alpn: tuple[str, ...]) -> ssl.SSLContext: ...

    def on_no_h2(self) -> None:
        """ALPN chose HTTP/1.1: switch this upstream to an HTTP/1.1 pool (once)."""


class H2Owner(Protocol):
    """What an HTTP/2 connection needs of its pool (h2pool.H2Pool)."""

    @property
    def front(self) -> Front: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def tally(self) -> Tally: ...

    @property
    def waiting(self) -> Sized: ...

    @property
    def warmup_path(self) -> bytes: ...

    @property
    def warmup_headers(self) -> Headers: ...

    def warmup_attempt(self, client: Client) -> Attempt:
        """The attempt for a new connection's warm-up request (its deadline: connect timeout)."""

    def warmup_expired(self, what: str) -> None:
        """Count and log a warm-up left unanswered (`what` names the connection)."""

    def went_down(self, what: str) -> None:
        """A new connection failed (`what` says how): logged once while the upstream is down."""

    def mark_dirty(self, conn: H2Connection) -> None:
        """Flush this connection's frames once, after the current batch."""

    def on_connected(self, conn: H2Connection) -> None: ...

    def on_ready(self, conn: H2Connection) -> None: ...

    def on_capacity(self, conn: H2Connection) -> None:
        """The connection can take more streams: give it queued attempts."""

    def on_draining(self, conn: H2Connection) -> None:
        """The connection takes no new streams: start its replacement."""

    def on_closed(self, conn: H2Connection, was_ready: bool) -> None: ...


class H1Owner(Protocol):
    """What an HTTP/1.1 connection needs of its pool (h1pool.H1Pool)."""

    @property
    def front(self) -> Front: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def tally(self) -> Tally: ...

    def on_idle(self, conn: H1Connection, answered: bool = True) -> None:
        """The connection finished a response (answered) and can be reused."""

    def on_closed(self, conn: H1Connection) -> None: ...

