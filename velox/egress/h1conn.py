"""One HTTP/1.1 keep-alive upstream connection (the fallback when the upstream has no h2).

One attempt at a time per connection; the pool keeps idle connections and opens more on
demand. The response is parsed with httptools and reported to the attempt's client like the
HTTP/2 path does. Backpressure: when the client stops reading, we stop reading the upstream
socket (the attempt is marked as withholding) until it reads again, or the attempt ends, which
`_release` (the one exit of an attempt) turns back on. A large request body is written a slice
per loop pass, as on HTTP/2, since TLS encrypts inside transport.write.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

import httptools

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

    def on_idle(self, conn: H1Connection, answered: bool = True) -> None:
        """The connection finished a response (answered) and can be reused."""

    def on_closed(self, conn: H1Connection) -> None: ...


class H1Connection(asyncio.BufferedProtocol):
    __slots__ = (
        "read_buffer",
        "pool", "transport", "parser", "attempt", "headers", "status", "keep_alive",
        "closed", "reading_paused", "warm", "authority", "idle_since",
        "body_rest", "write_paused", "write_scheduled", "held", "held_body",
    )

    def __init__(self, pool: H1Owner) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.attempt: UpstreamCall | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.keep_alive = True
        self.closed = False
        self.reading_paused = False
        self.warm = False
        self.idle_since = 0.0
        self.authority = pool.front.spec.authority.encode()
        self.read_buffer = memoryview(bytearray(_READ_BUFFER))
        self.body_rest: memoryview | None = None  # the part of a large body not yet written
        self.write_paused = False
        self.write_scheduled = False
        # A response head read but not yet reported: if its body ends within the same read
        # (the common short answer), the client gets it all at once (Client.on_answer, as the
        # HTTP/2 codec's ANSWER event); else head and body so far go out when the read ends.
        self.held = False
        self.held_body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, attempt: UpstreamCall) -> None:
        client = attempt.client
        method, body = client.method, client.body
        self.attempt = attempt
        attempt.conn = self
        attempt.stream_id = 0
        parts: list[bytes | bytearray | memoryview] = [
            method, b" ", client.path, b" HTTP/1.1\r\nhost: ", self.authority, b"\r\n"]
        for name, value in client.headers_out:
            parts += (name, b": ", value, b"\r\n")
        if body or method == b"POST":
            parts.append(b"content-length: %d\r\n" % len(body or b""))
        parts.append(b"\r\n")
        large = len(body) > WRITE_SLICE
        if body and not large:
            parts.append(body)
        attempt.t_sent = time.perf_counter_ns()
        self.transport.write(b"".join(parts))  # type: ignore[union-attr]
        if large:
            # A memoryview is the arena's and may be reused before the last slice is out.
            self.body_rest = memoryview(bytes(body) if type(body) is memoryview else body)
            self._write_body()

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
        if self.body_rest is not None:
            # The upstream answered before the whole body was sent: the rest would be read
            # as the next request, so this connection cannot be reused.
            self.body_rest = None
            self.close()
        elif self.keep_alive and not self.closed:
            self.pool.on_idle(self)
        else:
            self.close()

    # --- transport callbacks ------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        # httptools parses the view in place; the callbacks receive their own bytes. Not
        # through data_received: one Python frame less per read, i.e. per streamed event.
        try:
            self.parser.feed_data(self.read_buffer[:nbytes])
        except httptools.HttpParserError as exc:
            self._protocol_error(exc)
        if self.held:
            self._report_head()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._protocol_error(exc)
        if self.held:
            self._report_head()

    def _protocol_error(self, exc: Exception) -> None:
        log.warning("upstream HTTP/1.1 protocol error: %s", exc)
        self._fail(UpstreamProtocolError(f"upstream HTTP/1.1 protocol error: {exc}"))
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self._fail(UpstreamUnavailable("the upstream closed the connection"))
        self.closed = True
        self.pool.on_closed(self)

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
        # HTTP/1.1 cannot cancel one request: the connection has to go.
        if attempt is self.attempt:
            self._release(attempt)
            if not self.closed:  # a connection we already close stops nothing more
                self.pool.tally.cancelled()
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    # --- for the pool -------------------------------------------------------------------------

    def live(self) -> list[UpstreamCall]:
        return [] if self.attempt is None else [self.attempt]
