"""One HTTP/1.1 keep-alive upstream connection (the fallback when the upstream has no h2).

One request at a time per connection; the pool keeps idle connections and opens more on
demand. The response is parsed with httptools and reported to the exchange like the HTTP/2
path does. Backpressure: when the client of the current exchange stops reading, we stop
reading the upstream socket until it drains.

Imports: errors, stdlib, httptools.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import httptools

from velox.errors import UpstreamProtocolError, UpstreamUnavailable

if TYPE_CHECKING:
    from velox.egress.pool import Pool

log = logging.getLogger("velox.egress")


# Reads land in a buffer of ours (see READ_BUFFER in h2conn for why).
_READ_BUFFER = 64 * 1024


class H1Connection(asyncio.BufferedProtocol):
    __slots__ = (
        "read_buffer",
        "pool", "transport", "parser", "sink", "headers", "status", "keep_alive",
        "closed", "reading_paused", "warm", "authority", "idle_since",
    )

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.sink: Any = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.keep_alive = True
        self.closed = False
        self.reading_paused = False
        self.warm = False
        self.idle_since = 0.0
        self.authority = pool.authority.encode()
        self.read_buffer = memoryview(bytearray(_READ_BUFFER))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, sink: Any, method: bytes, path: bytes, headers: list, body: Any) -> None:
        self.sink = sink
        sink.link = self
        sink.stream_id = 0
        parts = [method, b" ", path, b" HTTP/1.1\r\nhost: ", self.authority, b"\r\n"]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if body or method == b"POST":
            parts.append(b"content-length: %d\r\n" % len(body or b""))
        parts.append(b"\r\n")
        if body:
            parts.append(body)
        sink.t_sent = time.perf_counter_ns()
        self.transport.write(b"".join(parts))  # type: ignore[union-attr]

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
        if self.sink is not None:
            self.sink.on_response(self.status, self.headers, False)

    def on_body(self, body: bytes) -> None:
        sink = self.sink
        if sink is not None:
            sink.on_data(body, False)
            sink.consumed(len(body))

    def on_message_complete(self) -> None:
        if self.status < 200:
            return
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.on_data(b"", True)
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        if self.keep_alive and not self.closed:
            self.pool.h1_idle(self)
        else:
            self.close()

    # --- transport callbacks ------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        # httptools parses the view in place; the callbacks receive their own bytes.
        self.data_received(self.read_buffer[:nbytes])  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            log.warning("upstream HTTP/1.1 protocol error: %s", exc)
            self._fail(UpstreamProtocolError(f"upstream HTTP/1.1 protocol error: {exc}"))
            if self.transport is not None:
                self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self._fail(UpstreamUnavailable("the upstream closed the connection"))
        self.closed = True
        self.pool.h1_closed(self)

    def _fail(self, exc: Exception) -> None:
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.on_error(exc)

    # --- link interface (called by the exchange) -----------------------------------------------

    def acknowledge(self, sink: Any, n: int) -> None:
        if self.reading_paused and sink is self.sink:
            self.reading_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]

    def pause_for(self, sink: Any) -> None:
        if not self.reading_paused and sink is self.sink and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def cancel(self, sink: Any) -> None:
        # HTTP/1.1 cannot cancel one request: the connection has to go.
        if sink is self.sink:
            self.sink = None
            self.pool.streams_cancelled += 1
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
