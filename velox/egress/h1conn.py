"""One HTTP/1.1 keep-alive upstream connection (the fallback when the upstream has no h2).

One attempt at a time per connection, unless the upstream allows pipelining (its
`http1_pipeline` above 1: the pool then writes a micro-batch's requests on one connection with
one write, `queue` then `flush_out`, and they are answered in order: `behind` holds those
written after the one being answered). The pool keeps idle connections and opens more on
demand. The response is parsed with httptools and reported to the attempt's client like the
HTTP/2 path does. Backpressure: when the client stops reading, we stop reading the upstream
socket (the attempt is marked as withholding) until it reads again, or the attempt ends, which
`_release` (the one exit of an attempt) turns back on. A large request body is written a slice
per loop pass, as on HTTP/2, since TLS encrypts inside transport.write.

Two readers share everything else (`H1Base`): `H1Connection`, whose reads are parsed in C
(`velox._native.H1Reader`: uvloop's get_buffer/buffer_updated are C methods, the head is read by
vx_h1resp, the body's framing decoded there, and Python is called at most once per read, e.g.
once per streamed event), and its twin `PyH1Connection`, httptools throughout (VELOX_NATIVE=0,
and what the native reader hands a connection to on a head outside its subset: 1xx interim
answers, HTTP/1.0, close-delimited bodies, odd framing fields).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

import httptools

from velox import _native
from velox.core.errors import UpstreamProtocolError, UpstreamUnavailable
from velox.egress.h2conn import WRITE_SLICE
from velox.egress.interfaces import UpstreamCall

if TYPE_CHECKING:
    from velox.egress.interfaces import Front, Tally

log = logging.getLogger("velox.egress")


# Reads land in a buffer of ours (see READ_BUFFER in h2conn for why).
_READ_BUFFER = 64 * 1024


class H1Owner(Protocol):
    """What an HTTP/1.1 connection needs of its pool (h1pool.H1Pool)."""

    @property
    def front(self) -> Front: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def tally(self) -> Tally: ...

    def on_idle(self, conn: H1Base, answered: bool = True) -> None:
        """The connection finished a response (answered) and can be reused."""

    def on_closed(self, conn: H1Base) -> None: ...


_SLOTS = (
    "pool", "transport", "parser", "attempt", "headers", "status", "keep_alive",
    "closed", "reading_paused", "warm", "authority", "idle_since",
    "body_rest", "write_paused", "write_scheduled", "held", "held_body",
    "behind", "out", "unsent",
)


class _Dropped:
    """The client of an answer nobody waits for: a pipelined request whose client left (or
    timed out). Its answer is still read, and dropped, so the requests behind it keep their
    connection. One instance serves all (`attempt` stays None, so nothing retries it)."""

    __slots__ = ()
    attempt = None
    method = b"POST"
    paused = False

    def on_response(self, status: int, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        pass

    def on_data(self, data: bytes, end_stream: bool) -> None:
        pass

    def on_answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        pass

    def on_error(self, exc: BaseException) -> None:
        pass


_DROPPED: Any = _Dropped()


class H1Base(asyncio.BufferedProtocol):
    """Sending, backpressure, the attempt's end and httptools' callbacks: both readers'."""

    if not TYPE_CHECKING:  # no slots of its own: the C base of H1Connection has the layout
        __slots__ = ()
    if TYPE_CHECKING:  # the concrete classes' slots
        pool: H1Owner
        transport: asyncio.Transport | None
        parser: Any  # httptools.HttpResponseParser, or None until the native reader falls back
        attempt: UpstreamCall | None
        headers: list[tuple[bytes, bytes]]
        status: int
        keep_alive: bool
        closed: bool
        reading_paused: bool
        warm: bool
        idle_since: float
        authority: bytes
        body_rest: memoryview | None
        write_paused: bool
        write_scheduled: bool
        held: bool
        held_body: list[bytes]
        behind: deque[UpstreamCall]
        out: list[bytes]
        unsent: int

    def __init__(self, pool: H1Owner) -> None:
        self.pool = pool
        self.transport = None
        self.parser = None
        self.attempt = None
        self.headers = []
        self.status = 0
        self.keep_alive = True
        self.closed = False
        self.reading_paused = False
        self.warm = False
        self.idle_since = 0.0
        self.authority = pool.front.spec.authority.encode()
        self.body_rest = None  # the part of a large body not yet written
        self.write_paused = False
        self.write_scheduled = False
        # A response head read but not yet reported: if its body ends within the same read
        # (the common short answer), the client gets it all at once (Client.on_answer, as the
        # HTTP/2 codec's ANSWER event); else head and body so far go out when the read ends.
        self.held = False
        self.held_body = []
        # Pipelining: attempts written (or queued in `out`) after `attempt`, in order; the
        # last `unsent` of [attempt, *behind] are still in `out`, not written.
        self.behind = deque()
        self.out = []
        self.unsent = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, attempt: UpstreamCall) -> None:
        """Write the request now (the connection carries nothing else)."""
        body = attempt.client.body
        self.transport.write(self._carry(attempt))  # type: ignore[union-attr]
        if body and len(body) > WRITE_SLICE:
            # A memoryview is the arena's and may be reused before the last slice is out.
            self.body_rest = memoryview(bytes(body) if type(body) is memoryview else body)
            self._write_body()

    def queue(self, attempt: UpstreamCall) -> None:
        """Pipelining: the request (a small body, not HEAD: the pool's rule) is written with
        the others of its batch by `flush_out`, behind any the connection carries."""
        self.out.append(self._carry(attempt))
        self.unsent += 1

    def flush_out(self) -> None:
        """One write for every request queued since the last one."""
        out = self.out
        if out:
            self.out = []
            self.unsent = 0
            if not self.closed and self.transport is not None:
                self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def _current(self, attempt: UpstreamCall) -> None:
        """`attempt` is the one the next response answers."""
        self.attempt = attempt

    def _carry(self, attempt: UpstreamCall) -> bytes:
        """Take the attempt on (answered next, or behind those in flight); the bytes of its
        request: the head, and the body unless it is larger than a write slice."""
        client = attempt.client
        method, body = client.method, client.body
        if self.attempt is None:
            self._current(attempt)
        else:
            self.behind.append(attempt)
        attempt.conn = self
        attempt.stream_id = 0
        parts: list[bytes | bytearray | memoryview] = [
            method, b" ", client.path, b" HTTP/1.1\r\nhost: ", self.authority, b"\r\n"]
        for name, value in client.headers_out:
            parts += (name, b": ", value, b"\r\n")
        if body or method == b"POST":
            parts.append(b"content-length: %d\r\n" % len(body or b""))
        parts.append(b"\r\n")
        if body and len(body) <= WRITE_SLICE:
            parts.append(body)
        attempt.t_sent = time.perf_counter_ns()
        return b"".join(parts)

    def _write_body(self) -> None:
        self.write_scheduled = False
        rest = self.body_rest
        if rest is None or self.write_paused or self.closed or self.transport is None:
            return
        self.transport.write(rest[:WRITE_SLICE])
        if len(rest) > WRITE_SLICE:
            self.body_rest = rest[WRITE_SLICE:]
            if not self.write_paused:
                self.write_scheduled = True
                self.pool.loop.call_soon(self._write_body)
        else:
            self.body_rest = None

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.body_rest is not None and not self.write_scheduled:
            self._write_body()

    # --- parser callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status < 200:
            return  # interim response (100 Continue): the real one follows
        self.keep_alive = self.parser.should_keep_alive()
        # Hop-by-hop fields, those the Connection field names included, are the relay's to
        # drop (velox.relay.exchange.answer_head), as for HTTP/2 answers.
        attempt = self.attempt
        if attempt is not None:
            attempt.t_headers = time.perf_counter_ns()
            attempt.last_activity = time.monotonic()
            self.held = True  # reported by on_message_complete or at the end of this read

    def _report_head(self) -> None:
        """The read ended inside a response: its head and the body read so far to the client
        (a streamed answer's first event goes out in the same loop pass as before)."""
        self.held = False
        attempt = self.attempt
        if attempt is None:
            return
        attempt.client.on_response(self.status, self.headers, False)
        parts = self.held_body
        if parts:
            self.held_body = []
            self.on_body(parts[0] if len(parts) == 1 else b"".join(parts))

    def on_body(self, body: bytes) -> None:
        if self.held:
            self.held_body.append(body)
            return
        attempt = self.attempt
        if attempt is None:
            return
        attempt.last_activity = time.monotonic()
        client = attempt.client
        client.on_data(body, False)
        if attempt.conn is self and client.paused:
            attempt.withheld += len(body)
            if not self.reading_paused and self.transport is not None:
                self.reading_paused = True
                self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.status < 200:
            return
        attempt = self.attempt
        if attempt is not None:
            self._release(attempt)
            if self.held:  # the whole answer in this read: one call
                self.held = False
                parts = self.held_body
                self.held_body = []
                body = parts[0] if len(parts) == 1 else b"".join(parts)
                attempt.client.on_answer(self.status, self.headers, body)
            else:
                attempt.client.on_data(b"", True)
        self._message_done()

    def _message_done(self) -> None:
        """A response ended: the connection takes the next request, or closes."""
        if self.body_rest is not None:
            # The upstream answered before the whole body was sent: the rest would be read
            # as the next request, so this connection cannot be reused.
            self.body_rest = None
            self.close()
        elif self.keep_alive and not self.closed:
            if self.behind:
                self._current(self.behind.popleft())
            else:
                self.pool.on_idle(self)
        else:
            # A server that answers with "Connection: close" processes nothing after that
            # request (RFC 9112, 9.6): the requests pipelined behind it are sent again.
            self.close()
            self._resend_all(self._take_behind())

    def _feed_py(self, data: bytes | memoryview) -> None:
        """Bytes for httptools (the twin's every read; the native reader's after a fallback)."""
        assert self.parser is not None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._protocol_error(exc)
        if self.held:
            self._report_head()

    # --- transport callbacks ------------------------------------------------------------------

    def _protocol_error(self, exc: Exception) -> None:
        log.warning("upstream HTTP/1.1 protocol error: %s", exc)
        self._fail(UpstreamProtocolError(f"upstream HTTP/1.1 protocol error: {exc}"))
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        closed, self.closed = self.closed, True  # from here no retry can land on it
        unsent = self.unsent
        behind = self._take_behind()
        attempt = self.attempt
        if attempt is not None and unsent > len(behind):  # never written: send it again
            self._release(attempt)
            self._resend_all([attempt])
        elif not closed:
            self._fail(UpstreamUnavailable("the upstream closed the connection"))
        # Pipelined behind the answer in progress: written ones may have been processed (502,
        # which routing may retry elsewhere before anything reached the client); those still
        # in `out` were not, and are sent again.
        written = len(behind) - min(unsent, len(behind))
        for waiting in behind[:written]:
            waiting.client.on_error(UpstreamUnavailable(
                "the upstream closed the connection with the request pipelined on it"))
        self._resend_all(behind[written:])
        self.pool.on_closed(self)

    def _take_behind(self) -> list[UpstreamCall]:
        """The attempts pipelined behind the current one, detached from this connection."""
        behind = list(self.behind)
        self.behind.clear()
        self.out = []
        self.unsent = 0
        for attempt in behind:
            attempt.conn = None
        return behind

    def _resend_all(self, attempts: list[UpstreamCall]) -> None:
        """Attempts the upstream provably did not process: to the `Upstream` to send again."""
        front = self.pool.front
        for attempt in attempts:
            if not front.retry(attempt):
                attempt.client.on_error(UpstreamUnavailable(
                    "the upstream closed the connection before this request"))

    def _fail(self, exc: Exception) -> None:
        self.held = False  # a head not reported yet: the error is all the client hears
        self.held_body = []
        attempt = self.attempt
        if attempt is not None:
            self._release(attempt)
            attempt.client.on_error(exc)

    def _release(self, attempt: UpstreamCall) -> None:
        """The one exit of an attempt: forget it and read again if it held reading back."""
        self.attempt = None
        attempt.conn = None
        attempt.withheld = 0
        if self.reading_paused:
            self.reading_paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()

    # --- Carrier: called through the attempt ----------------------------------------------------

    def credit(self, attempt: UpstreamCall) -> None:
        if attempt is self.attempt and attempt.withheld:
            attempt.withheld = 0
            if self.reading_paused and self.transport is not None:
                self.reading_paused = False
                self.transport.resume_reading()

    def cancel(self, attempt: UpstreamCall) -> None:
        # HTTP/1.1 cannot cancel one request: the connection has to go, unless requests are
        # pipelined behind it; then its answer is read and dropped (a stuck one still ends
        # the connection: the stand-in keeps its deadline).
        if attempt is self.attempt:
            self._release(attempt)
            if self.behind and attempt.client is not _DROPPED:
                self._current(_stand_in(self, attempt, attempt.deadline))
                return
            if not self.closed:  # a connection we already close stops nothing more
                self.pool.tally.cancelled()
            self.close()
        elif attempt.conn is self and attempt.client is not _DROPPED:
            # Pipelined behind: its answer will be dropped; its deadline is the current one's
            # to keep (a sweep would otherwise expire the stand-in again every tick).
            self.behind[self.behind.index(attempt)] = _stand_in(self, attempt, float("inf"))
            attempt.conn = None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    # --- for the pool -------------------------------------------------------------------------

    def live(self) -> list[UpstreamCall]:
        return ([] if self.attempt is None else [self.attempt]) + list(self.behind)


def _stand_in(conn: H1Base, attempt: UpstreamCall, deadline: float) -> UpstreamCall:
    """An attempt in place of `attempt` on `conn` whose answer is dropped (see `cancel`)."""
    stand_in = UpstreamCall(_DROPPED, attempt.number, deadline)
    stand_in.conn = conn
    stand_in.t_sent, stand_in.t_headers = attempt.t_sent, attempt.t_headers
    stand_in.last_activity = attempt.last_activity
    return stand_in


class PyH1Connection(H1Base):
    """The twin: every read parsed by httptools, through its per-field callbacks."""

    __slots__ = (*_SLOTS, "read_buffer")

    def __init__(self, pool: H1Owner) -> None:
        super().__init__(pool)
        self.parser = httptools.HttpResponseParser(self)
        self.read_buffer = memoryview(bytearray(_READ_BUFFER))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        # httptools parses the view in place; the callbacks receive their own bytes. Not
        # through data_received: one Python frame less per read, i.e. per streamed event.
        self._feed_py(self.read_buffer[:nbytes])

    def data_received(self, data: bytes) -> None:
        self._feed_py(data)


class H1Connection(_native.H1Reader, H1Base):
    """The native reader (velox._native.H1Reader: get_buffer, buffer_updated, data_received
    and `read_buffer` are C); it reports each read here in one call."""

    __slots__ = _SLOTS

    def _current(self, attempt: UpstreamCall) -> None:
        self.attempt = attempt
        self.no_body = attempt.client.method == b"HEAD"  # its answer's framing fields lie

    def _take_head(self, status: int, headers: list[tuple[bytes, bytes]],
                   keep_alive: bool) -> UpstreamCall | None:
        """A response head: kept, and timed on the attempt it answers (returned, if any)."""
        self.status = status
        self.headers = headers
        self.keep_alive = keep_alive
        attempt = self.attempt
        if attempt is not None:
            attempt.t_headers = time.perf_counter_ns()
            attempt.last_activity = time.monotonic()
        return attempt

    def _h_answer(self, status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool,
                  body: bytes) -> None:
        """A whole response in this read: one call to the client (on_answer)."""
        attempt = self._take_head(status, headers, keep_alive)
        if attempt is not None:
            self._release(attempt)
            attempt.client.on_answer(status, headers, body)
        self._message_done()

    def _h_head(self, status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool,
                body: bytes) -> None:
        """A head whose body goes on past this read: the head, then the body so far."""
        attempt = self._take_head(status, headers, keep_alive)
        if attempt is None:
            return
        client = attempt.client
        client.on_response(status, headers, False)
        # A stream the relay passes through: its plain reads go from C to the client.
        route = getattr(client, "direct_route", None)
        if route is not None and attempt.conn is self:
            target = route()
            if target is not None:
                conn, write, sse, chunked = target
                self.direct(conn, write, sse, client, attempt, chunked)
        if body:
            self.on_body(body)

    def _h_body(self, body: bytes) -> None:
        self.on_body(body)

    def _h_withhold(self, size: int) -> None:
        """A read the direct path wrote filled the client's buffer: stop reading (on_body's
        backpressure, for the bytes C sent)."""
        attempt = self.attempt
        if attempt is not None and attempt.conn is self:
            attempt.withheld += size
            if not self.reading_paused and self.transport is not None:
                self.reading_paused = True
                self.transport.pause_reading()

    def _release(self, attempt: UpstreamCall) -> None:
        self.undirect()
        H1Base._release(self, attempt)

    def _h_end(self, body: bytes) -> None:
        """The last body bytes of a response whose head came in an earlier read (reported as
        httptools' callbacks do: the piece, then the end)."""
        if body:
            self.on_body(body)
        attempt = self.attempt
        if attempt is not None:
            self._release(attempt)
            attempt.client.on_data(b"", True)
        self._message_done()

    def _h_error(self, message: str) -> None:
        self._protocol_error(ValueError(message))

    def _h_fallback(self, data: bytes) -> None:
        """A head outside the native subset: httptools reads the connection from here on."""
        if self.closed:
            return
        if self.parser is None:
            self.parser = httptools.HttpResponseParser(self)
        self._feed_py(data)
