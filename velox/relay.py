"""Relay: carry one upstream response back to its client, streamed or whole.

An `Exchange` is created by the worker for every admitted request and handed to the egress
pool, which reports the upstream's response through it (`on_response`, `on_data`, `on_error`).
Server-sent events (any `text/event-stream` response) are relayed chunk by chunk as each
upstream DATA frame arrives: no buffering, `data: [DONE]` passed through untouched. Other
responses are short JSON documents, so they are collected and sent with one write and a
Content-Length, unless they grow past `_BUFFER_LIMIT`, in which case they are streamed too.

Backpressure runs end to end: a streaming client that stops reading pauses our writes to it,
and while it is paused we stop crediting the upstream's HTTP/2 flow-control window, so the
upstream slows down instead of our memory growing. A client that disconnects cancels the
upstream stream (RST_STREAM) at once, so no tokens are paid for after the user has left.

Imports: _types, errors, stats (field numbers) and stdlib.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from velox._types import Headers, Request

# Response headers that describe the upstream connection, not the response (RFC 9110 §7.6.1),
# plus content-length, which ingress writes from the bytes it actually sends. Fields an
# HTTP/1.1 upstream names in its Connection header are removed by h1conn before they get here.
# HTTP/2 (RFC 9113 §8.2.2) forbids connection-specific fields; with the framer such a response
# is accepted and this filter strips them (the set below holds all of them), which costs nothing
# extra; the h2/jh2 codecs validate headers themselves and treat it as a protocol error (502).
# Connection has no meaning in HTTP/2, so the names an HTTP/2 Connection field lists are not
# honoured, only the field itself is dropped.
_DROP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade",
    b"te", b"trailer", b"content-length", b"proxy-authenticate", b"alt-svc",
})
_EVENT_STREAM = b"text/event-stream"
# Non-streaming bodies larger than this are relayed as they arrive instead of collected.
_BUFFER_LIMIT = 1 << 20


class Exchange:
    """One request's round trip through the upstream (an UpstreamSink for egress)."""

    __slots__ = (
        "request", "conn", "path", "headers_out", "link", "stream_id", "on_done", "on_release",
        "status", "headers", "chunks", "size", "streaming", "started", "finished",
        "unacked", "t_sent", "t_headers", "last_activity", "attempts", "deadline",
    )

    def __init__(self, request: Request, path: bytes, headers_out: Headers,
                 on_done: Callable[[Exchange, int], None],
                 on_release: Callable[[Request], None]) -> None:
        self.request = request
        self.conn = request.conn
        self.path = path  # upstream path
        self.headers_out = headers_out  # upstream headers (hop-by-hop dropped, auth applied)
        request.exchange = self
        self.link: Any = None  # the upstream connection (or queue) that holds this exchange
        self.stream_id = 0
        self.on_done = on_done  # (exchange, status) once the client has its full answer
        self.on_release = on_release  # frees the request body once no retry can need it
        self.status = 0
        self.headers: Headers = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.streaming = False
        self.started = False  # response head sent to the client
        self.finished = False
        self.unacked = 0  # flow-controlled bytes not yet credited back to the upstream
        self.t_sent = 0
        self.t_headers = 0
        self.last_activity = 0.0
        self.attempts = 0
        self.deadline = 0.0

    # --- what the request carries upstream ------------------------------------------------

    @property
    def body(self) -> bytes | memoryview:
        return self.request.body

    # --- egress → client ------------------------------------------------------------------

    def on_response(self, status: int, headers: Headers, end_stream: bool) -> None:
        if self.finished:
            return
        self.t_headers = time.perf_counter_ns()
        self.last_activity = time.monotonic()
        self.on_release(self.request)  # the upstream has the request: no retry can need it
        out = [h for h in headers if h[0] not in _DROP]
        out.append((b"server-timing", self._server_timing()))
        self.status = status
        self.headers = out
        for name, value in headers:
            if name == b"content-type":
                if value.startswith(_EVENT_STREAM):
                    self._start_streaming()
                break
        if end_stream:
            self._complete()

    def on_data(self, data: bytes, end_stream: bool) -> None:
        if self.finished:
            return
        self.last_activity = time.monotonic()
        if self.streaming:
            self.conn.send_chunk(data)
        else:
            self.chunks.append(data)
            self.size += len(data)
            if self.size > _BUFFER_LIMIT:
                self._start_streaming()
        if end_stream:
            self._complete()

    def on_error(self, exc: BaseException) -> None:
        if self.finished:
            return
        self.finished = True
        self._return_credit()  # reset by the upstream or the codec, expired, connection lost
        self.on_release(self.request)
        if self.started:
            # Part of the response is already with the client: all HTTP/1.1 can do is cut the
            # connection, which the client sees as an error rather than a silent truncation.
            self.conn.abort()
        else:
            self.conn.respond_error(self.request, exc)
        self._done(getattr(exc, "status", 502))

    # --- flow control ---------------------------------------------------------------------

    def consumed(self, n: int) -> None:
        """n flow-controlled bytes were delivered to us: credit them now or when the client drains."""
        link = self.link
        if link is None:
            return
        if self.conn.write_paused and not self.finished:  # type: ignore[attr-defined]
            self.unacked += n
            link.pause_for(self)
        else:
            link.acknowledge(self, n)

    # --- ingress → egress -----------------------------------------------------------------

    def client_gone(self) -> None:
        if self.finished:
            return
        self.finished = True
        self._return_credit()  # before the cancel: the stream still exists in the codec
        self.on_release(self.request)
        if self.link is not None:
            self.link.cancel(self)
        self._done(499)

    def client_writable(self) -> None:
        if self.unacked and self.link is not None and not self.finished:
            n, self.unacked = self.unacked, 0
            self.link.acknowledge(self, n)

    # --- internals ------------------------------------------------------------------------

    def _return_credit(self) -> None:
        """Hand the connection back the credit held for a paused client, at every ending.

        While the client is paused, `unacked` bytes are kept from the upstream's windows; once
        the exchange is over nothing else would ever return them, and the connection-level
        window is shared: ten abandoned 8 MiB streams drain a 64 MiB window to zero and every
        later stream on the connection stalls. The codec credits only the connection for a
        stream it has already closed or reset (codec.py, `acknowledge`), which is what we want.
        """
        n = self.unacked
        if n:
            self.unacked = 0
            link = self.link
            if link is not None:
                link.acknowledge(self, n)

    def _start_streaming(self) -> None:
        self.streaming = True
        self.started = True
        self.conn.start_stream(self.request, self.status, self.headers)
        if self.chunks:
            for chunk in self.chunks:
                self.conn.send_chunk(chunk)
            self.chunks = []

    def _complete(self) -> None:
        self.finished = True
        self._return_credit()  # the stream ended while the client was still paused
        if self.streaming:
            self.conn.end_stream()
        else:
            chunks = self.chunks
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            self.started = True
            self.conn.respond(self.request, self.status, self.headers, body)
        self._done(self.status)

    def _done(self, status: int) -> None:
        # Request and exchange point at each other; cutting the link here lets reference
        # counting free both at once instead of leaving a cycle for the garbage collector.
        self.request.exchange = None
        self.on_done(self, status)

    def _server_timing(self) -> bytes:
        r = self.request
        # One formatting call, integer microseconds shown as milliseconds: no float formatting.
        ring = max(0, r.t_popped - r.t_received) // 1000
        parse = max(0, r.t_parsed - r.t_popped) // 1000
        limit = max(0, r.t_admitted - r.t_parsed) // 1000
        upstream = max(0, self.t_headers - self.t_sent) // 1000
        return _TIMING % (ring // 1000, ring % 1000, parse // 1000, parse % 1000,
                          limit // 1000, limit % 1000, upstream // 1000, upstream % 1000)


_TIMING = (b"ring;dur=%d.%03d, parse;dur=%d.%03d, ratelimit;dur=%d.%03d, "
           b"upstream;dur=%d.%03d")
