"""Ingress: the HTTP/1.1 server of a worker, written directly on asyncio.Protocol and httptools.

One `ClientConnection` per client socket. It parses requests (see "Two parsers" below), answers
on its own what needs no upstream (health probes, 404/405/401/413/431, 503 while draining or
when the ring is full), copies each complete body into the worker's arena and pushes the
`Request` onto the worker's ring; the worker answers later through the `Responder` methods
below. There is no Task and no framework per request: a request costs the parser callbacks, one
ring push, and one write for its response.

Requests pipelined on one connection are answered in order: while one is in flight the next
ones wait here (and reading pauses), because HTTP/1.1 responses cannot be reordered.

Memory follows the bytes that arrived, never what a header declares: a body grows as it comes
(`Content-Length: 16000000` and one byte cost one byte), and a request must arrive whole -
request line, headers and body - within VELOX_BODY_TIMEOUT_MS of its first byte, or it gets a
408 and the connection is closed (the worker's tick calls `expire_receive`). Without that
deadline a client trickling a byte every few seconds would hold its buffer forever, since every
byte refreshes the keep-alive idle clock.

Two parsers. The native one, the default: a connection starts on the native
request-head parser (native/vx_reqhead.c via `velox.ingress.reqhead`), which takes a whole head in
one call and returns method, target, the lower-cased header list, Content-Length, the
authorization value, expect-100, keep-alive and the head's length; the body is then taken by
its Content-Length, and the same steps as httptools' callbacks (`_head_complete`, `on_body`,
`on_message_complete`) build the Request. That parser accepts only a strict subset it fully
validates; at the first head outside it (chunked bodies, upgrades, obs-fold, odd framing or
Connection values, a head over the limits, anything malformed) the connection hands every
byte not yet consumed to httptools for the rest of its life, so every odd case keeps
httptools' exact behaviour and error texts. Its reference twin (VELOX_NATIVE=0): httptools'
callbacks from the first byte. Both make identical Requests and answers: the differential
tests (tests/native/test_reqhead_fuzz.py) feed generated traffic to both and to llhttp split
at every byte boundary. Why: httptools calls Python once per header field (15 for the SDK's
request) plus five more per request; measured on this 2-core host under load, the SDK's
request costs ingress 23.2 us with httptools and 11.7 us natively (min of 30 rounds,
benches/bench_ingress.py), and the socket-free worker path (64 clients, native codec)
95.8 -> 82.5 us of CPU per request (medians of 30 interleaved blocks; paired saving 13.8 us).

Writing answers. An answer of up to WHOLE_BYTES is built with its head by one native call and
written at once (a chat completion is a few KiB). A larger body, and a stream's bytes whenever the
client is not taking them, go through the connection's send queue: slices of the caller's own
objects (nothing copied there), written at most `_WRITE_PIECE` bytes per transport write and
only while the transport is not paused (pause_writing: its buffer is over 64 KiB). So a client
that does not read holds the transport's buffer of its own, not a copy of its answer, and one
answer written to many such clients (a cached one: velox.cache.front) is held once. Requests
pipelined behind a paused answer wait for resume_writing before they are answered. A
connection whose writes stay paused for VELOX_WRITE_TIMEOUT_MS (the client took nothing in
that time) is aborted, dropping what it holds (the worker's tick calls `expire_write`): close()
would wait for the buffer to drain, which a client that never reads never lets happen, and the
keep-alive timeout only closes connections that have nothing to send.

Refused at header time, then closed: protocol upgrades (400 bad_http_request: httptools would
otherwise complete the message first and the client got an empty reply), transfer codings other
than chunked (501, RFC 9112 §6.1), any Transfer-Encoding on HTTP/1.0 (400: faulty framing,
§6.1), an HTTP/1.1 request without Host and any request with two Host fields or an invalid
Host (400, §3.2), more than one Authorization field (400: the key check, the cache's
partition and the upstream must all read the same credential), more than MAX_FIELDS header
fields (431), and request lines of HTTP/0.9 (llhttp reads a line without a version as one) or
HTTP/2.0 (505: llhttp parses both, and they would otherwise be answered as HTTP/1.1). An
absolute-form target (`POST http://host/v1/...`, §3.2.2) is served as its path and query; its
authority is checked like a Host and otherwise ignored, as Host is: Velox routes by path
alone. Trailer fields of a chunked body are dropped, never forwarded as headers. The native
parser accepts none of these heads (see native/vx_reqhead.h), so each rule is applied once, on
the httptools path, for both settings.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import httptools
import orjson

from velox.core.api import MESSAGES_PATH, OPENAI, client_api
from velox.core.errors import (
    BadHTTP,
    BadRequest,
    HeadersTooLarge,
    InternalError,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    ShuttingDown,
    UnsupportedTransferCoding,
    VeloxError,
    VersionNotSupported,
    to_response,
)
from velox.core.types import ANSWERING, DONE, Kind, Lifecycle, Request
from velox.ingress import h1write, reqhead
from velox.ingress.arena import Arena
from velox.ingress.auth import Auth
from velox.ingress.classify import classify, normal_target
from velox.ingress.h1write import H1_CHUNKED, H1_CLOSE, H1_LENGTH, STATUS_LINES
from velox.ingress.headers import HOP_BY_HOP
from velox.providers.messages import gateway_error

log = logging.getLogger("velox.ingress")

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_HEALTH_BODY = orjson.dumps({"status": "ok"})
_READY_BODY = orjson.dumps({"status": "ready"})
_JSON = ((b"content-type", b"application/json"),)
# Request headers ingress itself acts on; everything else is only collected.
_WATCHED = frozenset({b"content-length", b"authorization", b"expect", b"transfer-encoding",
                      b"host", b"traceparent"})
# Header fields per request, at most (431 beyond): the native parser's room for fields, so a
# head it cannot hold is exactly one this refuses. 100 is 6x what the SDKs send; before the
# cap a 54 KB head of 5,500 tiny fields cost about 65 times a normal request, and every field
# was forwarded.
MAX_FIELDS = reqhead.MAX_FIELDS
_TOO_MANY_FIELDS = (f"The request has more than {MAX_FIELDS} header fields; this gateway "
                    f"accepts at most {MAX_FIELDS}.")
# The bytes of uri-host [":" port] (RFC 3986: ALPHA DIGIT "-._~", sub-delims, "%" of
# pct-encoded, "[]:" of IP literals and the port), checked as a set as Go's net/http does; the
# native parser's C_HOST class is the same set.
_HOST = re.compile(rb"[0-9A-Za-z!$%&'()*+,\-.:;=\[\]_~]*")
# An absolute-form target: scheme http or https (any case), authority, the rest.
_ABSOLUTE = re.compile(rb"(?i:https?)://([^/?]*)(.*)", re.S)
_TWO_CREDENTIALS = "The request has more than one Authorization header; send exactly one."
# Pipelined requests queued behind the one in flight before reading pauses.
_PIPELINE_DEPTH = 8
# Kind's members as globals on the per-request path: reading one off its Enum class takes
# EnumType.__getattr__'s slow path on Python 3.11 (~0.3 us against ~0.04 for a global).
_ROOT, _FORWARD, _HEALTH = Kind.ROOT, Kind.FORWARD, Kind.HEALTH
_reqhead = reqhead.parse
# What the native parser leaves out of the upstream's share of the headers, in the same pass
# (auth.Auth.client_headers' rule: hop-by-hop fields and the client's credential); a second
# walk over the SDK's 15 fields in Python cost ~2.3 us per request.
_UPSTREAM_DROP = HOP_BY_HOP | {b"authorization"}
# Bodies declared larger than this are appended to one growing bytearray as they arrive, so
# completing a multi-megabyte upload costs no single large join on the loop. The buffer is
# never sized from Content-Length: it holds what arrived (CPython over-allocates ~12% per
# growth, and glibc grows blocks of 128 KiB and up with mremap, so appending copies no pages).
_ASSEMBLE_BYTES = 64 * 1024
# Bodies up to this size are written whole with their head (one native call, one write); the
# transport's high-water mark is 64 KiB too, so a client that does not read holds at most about
# this much of a whole answer in its transport buffer. Larger ones go through the send queue.
WHOLE_BYTES = 64 * 1024
# Largest single transport write from the send queue: a slice of the queued object, so writing
# a 6 MiB cached answer to a reading client costs ~25 writes and no copy of the answer.
_WRITE_PIECE = 256 * 1024
_LAST_CHUNK = h1write.LAST_CHUNK


class IngressState:
    """What every connection of one worker shares (uvicorn's ServerState, plus the ring)."""

    __slots__ = (
        "loop", "ring", "wake_drain", "arena", "auth", "max_body", "max_header",
        "connections", "draining", "is_ready", "ends", "overloaded", "receive_timeouts",
        "handoff", "unflushed", "flush_scheduled", "native", "write_timeouts", "reading",
        "pushed", "after_read", "first_client",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None,
        ring: Any,
        wake_drain: Callable[[], None],
        arena: Arena,
        auth: Auth,
        max_body: int,
        max_header: int,
        is_ready: Callable[[], bool],
        ends: Lifecycle | None,
        native: bool = True,
    ) -> None:
        self.loop = loop
        self.ring = ring
        self.wake_drain = wake_drain  # schedules one drain per loop pass; idempotent
        # A client read in progress pushes without waking the drain (`pushed` counts); at the
        # read's end `after_read(pushed)` decides: the worker drains a lone request at once.
        self.reading = False
        self.pushed = 0
        self.after_read: Callable[[int], None] = lambda pushed: wake_drain()
        # Called when a client connects to a worker that had none: its idle tick (once a
        # second) must watch this connection's deadlines at the busy period again.
        self.first_client: Callable[[], None] | None = None
        self.arena = arena
        self.auth = auth
        self.max_body = max_body
        self.max_header = max_header
        self.connections: set[ClientConnection] = set()
        self.draining = False
        self.is_ready = is_ready
        # The worker's end of every request (core.types.Lifecycle: Request.finish calls it);
        # None: requests end without anything to release or count (socket-free tests).
        self.ends = ends
        self.overloaded = 0  # requests refused because the ring was full
        self.receive_timeouts = 0  # requests cut off by VELOX_BODY_TIMEOUT_MS (408)
        self.write_timeouts = 0  # connections aborted by VELOX_WRITE_TIMEOUT_MS
        # Draining for a reload (a new worker took over): requests still arriving on open
        # connections are served, with Connection: close, instead of 503 shutting_down.
        self.handoff = False
        # Streams with bytes queued in this loop pass, written by one `flush` at its end.
        self.unflushed: list[ClientConnection] = []
        self.flush_scheduled = False
        # VELOX_NATIVE: new connections start on the native head parser (True) or on its
        # reference twin, httptools alone (False).
        self.native = native

    def flush_soon(self, conn: ClientConnection) -> None:
        """Queue conn's stream bytes for the end of this loop pass (one call_soon per pass)."""
        self.unflushed.append(conn)
        if not self.flush_scheduled:
            if self.loop is None:  # no loop (socket-free tests): write at once
                self.flush()
                return
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        conns, self.unflushed = self.unflushed, []
        for conn in conns:
            conn.flush_stream()


class _Refuse(Exception):
    """Raised inside a parser callback to stop parsing and answer with `error`, then close."""

    def __init__(self, error: VeloxError) -> None:
        self.error = error


class ClientConnection(asyncio.Protocol):
    __slots__ = (
        "state", "transport", "parser", "closed", "last_active", "write_paused",
        # the request being parsed
        "_url", "_headers", "_chunks", "_assembled", "_body_size", "_header_bytes",
        "_content_length", "_authorization", "_traceparent", "_expect", "_reject", "_kind",
        "_caller",
        # httptools only: trailer fields seen, a Host seen; the last Host value found valid on
        # this connection
        "_trailers", "_host", "_valid_host",
        "_upstream",  # the native parser's upstream share of _headers (Request.upstream_headers)
        "receiving_since", "_in_body",
        # the native path: still on it, unparsed head bytes, body bytes still due, the last
        # head's method and version (both paths set _http10), no request may follow (the last
        # one closes)
        "_native", "_buf", "_body_left", "_method", "_http10", "_keep_alive", "_after_close",
        # the request being answered, and those waiting behind it
        "current", "_pending", "_chunked", "_streaming", "_stream_status", "_stream_bytes",
        "read_paused", "refused",
        # a stream's bytes not yet written: its head, and the pieces of body (unframed)
        "_out_head", "_out",
        # the send queue (see "Writing answers"): objects to write, the offset into the first,
        # the bytes left, and how the request ends once they are written (None: not yet ended)
        "_q", "_q_off", "_q_bytes", "_q_done",
        # monotonic time writes were paused (the client stopped taking them); 0.0 when not
        "stalled_since",
    )

    def __init__(self, state: IngressState) -> None:
        self.state = state
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.last_active = 0.0
        self.write_paused = False
        self.current: Request | None = None
        self._pending: deque[tuple[Request, VeloxError | None]] | None = None
        self._chunked = True
        self._streaming = False
        self._stream_status = 0
        self._stream_bytes = 0
        self._out_head = b""
        self._out: list[bytes] | None = None  # None: nothing queued
        self._q: deque[bytes | memoryview] | None = None
        self._q_off = 0
        self._q_bytes = 0
        self._q_done: bool | None = None  # the keep-alive of the request once its bytes are out
        self.stalled_since = 0.0
        self.read_paused = False
        self.refused = False  # a request was refused mid-parse: nothing more is read
        # monotonic time of the first byte of the request being received; 0.0 between requests.
        self.receiving_since = 0.0
        self._native = state.native
        self._buf = b""
        self._body_left = 0
        self._method = b""
        self._http10 = False
        self._keep_alive = True
        self._after_close = False
        self._valid_host: bytes | None = None
        self._reset_message()

    # --- transport callbacks ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.last_active = time.monotonic()
        state = self.state
        if not state.connections and state.first_client is not None:
            state.first_client()
        state.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.state.connections.discard(self)
        self._out = None
        self._q = None
        self.parser = None  # type: ignore[assignment]  # it refers back to us: break the cycle
        current = self.current
        if current is not None:
            holder = current.exchange
            if holder is not None:
                holder.client_gone()  # cancels the upstream call, unless others wait for it
            if current.state != DONE:  # (a large answer queued whole finished already)
                # The client left before or during its answer (or the connection was cut:
                # a broken answer, a write timeout, the shutdown): the request ends here,
                # logged with what the client got (the stream's status once its head went).
                if self._streaming:
                    current.finish(self._stream_status, self._stream_bytes, holder)
                else:
                    current.finish(499, 0, holder)
        if self._pending:
            for request, _ in self._pending:  # pipelined behind it, never started
                request.finish(499, 0, None)
            self._pending = None

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self.refused:
            return  # the parser is in an error state; the connection closes after the refusal
        # Requests pushed during this read wake the drain once it ends (IngressState.reading).
        state = self.state
        state.reading = True
        try:
            if not self._native:
                self._feed(data)  # (which reports its callbacks' failures itself)
            else:
                try:
                    self._fast(data)
                except _Refuse as exc:
                    self._refuse(exc.error)
                except Exception as exc:  # as the httptools path reports a failing callback
                    log.error("request handling failed", exc_info=exc)
                    self._refuse(InternalError())
        finally:
            state.reading = False
            pushed = state.pushed
            if pushed:
                state.pushed = 0
                state.after_read(pushed)

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Refuse):
                self._refuse(cause.error)
            else:
                log.error("request handling failed", exc_info=cause)
                self._refuse(InternalError())
        except httptools.HttpParserUpgrade:
            self._refuse(BadHTTP("Protocol upgrades are not supported by this gateway."))
        except httptools.HttpParserError as exc:
            self._refuse(BadHTTP(f"Malformed HTTP request: {exc}"),
                         not isinstance(exc, httptools.HttpParserInvalidMethodError))

    def pause_writing(self) -> None:
        self.write_paused = True
        self.stalled_since = time.monotonic()

    def resume_writing(self) -> None:
        self.write_paused = False
        self.stalled_since = 0.0
        if self._q is not None:
            self._drain()
            if self.write_paused or self.closed:
                return
        current = self.current
        if current is None:
            if self._pending:  # answers held back while the client was not reading
                self._next()
        elif current.exchange is not None:
            current.exchange.client_writable()

    # --- parser callbacks -----------------------------------------------------------------

    def _reset_message(self) -> None:
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._chunks: list[bytes] = []
        self._assembled: bytearray | None = None
        self._body_size = 0
        self._header_bytes = 0
        self._trailers = 0
        self._host = False
        self._content_length = -1
        self._authorization: bytes | None = None
        self._traceparent: bytes | None = None
        self._expect = False
        self._reject: VeloxError | None = None
        self._kind: Kind | None = None
        self._caller: bytes | None = None  # digest of the key, when the auth check made it
        self._upstream: list[tuple[bytes, bytes]] | None = None
        self._in_body = False

    def on_message_begin(self) -> None:
        # llhttp calls this at the first byte of a request line: the receive deadline starts
        # (unless the native path had already started it for bytes it handed over).
        if not self.receiving_since:
            self.receiving_since = time.monotonic()
        self._reset_message()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._header_bytes += len(url)
        if self._header_bytes > self.state.max_header:
            raise _Refuse(HeadersTooLarge())

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        self._header_bytes += len(name) + len(value) + 4
        if self._header_bytes > self.state.max_header:
            raise _Refuse(HeadersTooLarge())
        headers = self._headers
        if self._in_body:  # a trailer field of a chunked body: counted against the limits, not kept
            self._trailers += 1
            if len(headers) + self._trailers > MAX_FIELDS:
                raise _Refuse(HeadersTooLarge(_TOO_MANY_FIELDS))
            return
        # A length test per field (~0.3 us for the SDK's 16) measured cheaper than a counter,
        # or than testing only at marks of the byte count.
        if len(headers) == MAX_FIELDS:
            raise _Refuse(HeadersTooLarge(_TOO_MANY_FIELDS))
        headers.append((name, value))
        if name in _WATCHED:
            if name == b"content-length":
                self._content_length = int(value)
            elif name == b"authorization":
                if self._authorization is not None:
                    # Which one counts would differ between hops (the key check read the
                    # last, a cache or an upstream may read the first): neither is guessed.
                    raise _Refuse(BadRequest(_TWO_CREDENTIALS, param="authorization"))
                self._authorization = value
            elif name == b"transfer-encoding":
                if self.parser.get_http_version() == "1.0":
                    raise _Refuse(BadHTTP(
                        "Transfer-Encoding is not defined for HTTP/1.0 (RFC 9112 §6.1); send "
                        "the body with Content-Length, or use HTTP/1.1."))
                _check_transfer_coding(value)
            elif name == b"host":
                if self._host:
                    raise _Refuse(BadHTTP("The request has more than one Host header field."))
                if value != self._valid_host:  # a client sends one Host on every request
                    if _HOST.fullmatch(value.rstrip(b" \t")) is None:
                        raise _Refuse(BadHTTP("The Host header field is not a host[:port]."))
                    self._valid_host = value
                self._host = True
            elif name == b"traceparent":  # b"": twice, which W3C Trace Context ignores
                self._traceparent = value if self._traceparent is None else b""
            elif value.lower() == b"100-continue":
                self._expect = True

    def on_headers_complete(self) -> None:
        self._in_body = True
        parser = self.parser
        if parser.should_upgrade():
            # Connection: Upgrade (h2c, websocket) or CONNECT. httptools would complete the
            # message and only then raise HttpParserUpgrade, too late to answer it.
            raise _Refuse(BadHTTP("Protocol upgrades are not supported by this gateway."))
        # ~0.3 us (a str.format in httptools); start_stream reads the flag it leaves, as on the
        # native path, instead of asking again.
        version = parser.get_http_version()
        self._http10 = version == "1.0"
        if version != "1.1" and version != "1.0":
            raise _Refuse(VersionNotSupported(
                f"HTTP/{version} requests are not served here; send HTTP/1.1."))
        if not self._host and version == "1.1":
            raise _Refuse(BadHTTP("An HTTP/1.1 request needs a Host header field."))
        if self._url[:1] != b"/":
            self._url = _origin_form(self._url)
        self._head_complete(parser.get_method())

    def _head_complete(self, method: bytes) -> None:
        """The head is in (either parser): route, authenticate, check the declared length."""
        state = self.state
        try:
            url = self._url
            if b"%" in url:  # escaped unreserved characters are routed decoded (classify.py)
                url = self._url = normal_target(url)
            kind = classify(method, url)
            if kind <= _ROOT:
                authorization = self._authorization
                if authorization is None and url.startswith(MESSAGES_PATH):
                    authorization = _x_api_key(self._headers)  # the Anthropic SDK's header
                self._caller = state.auth.check(authorization)
            self._kind = kind
        except VeloxError as exc:
            self._reject = exc
        if self._content_length > state.max_body:
            raise _Refuse(PayloadTooLarge(
                f"The request body is {self._content_length} bytes; this gateway accepts at "
                f"most {state.max_body} (VELOX_MAX_BODY_BYTES)."))
        if self._content_length > _ASSEMBLE_BYTES and self._reject is None:
            self._assembled = bytearray()  # grows as the body arrives, see _ASSEMBLE_BYTES
        if self._expect and self.transport is not None:
            if self._reject is not None:
                # The client holds its body back until told to send it: refuse now and close,
                # since we cannot know whether it will send the body anyway.
                raise _Refuse(self._reject)
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self.state.max_body:
            raise _Refuse(PayloadTooLarge(
                f"The request body exceeds {self.state.max_body} bytes (VELOX_MAX_BODY_BYTES)."))
        if self._reject is None:
            assembled = self._assembled
            if assembled is None:
                self._chunks.append(body)
            else:
                assembled += body

    def on_message_complete(self, method: bytes | None = None, keep_alive: bool = True) -> None:
        """The whole request is in: build it and start or queue it. httptools calls this with
        no arguments; the native path passes what its head parser found (one function for
        both, which is also what profiles of either path show for this stage)."""
        if method is None:
            method = self.parser.get_method()
            keep_alive = self.parser.should_keep_alive()
        state = self.state
        self.receiving_since = 0.0
        chunks = self._chunks
        body: bytes | bytearray | memoryview = b""
        segment = -1
        if self._assembled is not None:
            body = self._assembled
        elif chunks:
            placed = state.arena.put(chunks)
            if placed is not None:
                body, segment = placed
            else:
                body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        request = Request(
            self, method, self._url, self._kind or _FORWARD, self._headers, body,
            keep_alive, time.perf_counter_ns(), segment, state.ends,
        )
        if self._http10:
            request.http10 = True
        if self._traceparent is not None:
            request.traceparent = self._traceparent
        if self._caller is not None:
            request.caller = self._caller  # auth.caller_of's digest, already made
        upstream = self._upstream
        if upstream is not None:
            request.upstream_headers = (upstream, state.auth.passthrough_of(self._authorization))
        if self.current is None:
            self._start(request, self._reject)
        else:
            if self._pending is None:
                self._pending = deque()
            self._pending.append((request, self._reject))
            if len(self._pending) >= _PIPELINE_DEPTH and not self.read_paused:
                self.read_paused = True
                self.transport.pause_reading()  # type: ignore[union-attr]

    # --- the native path ------------------------------------------------------------------

    def _fast(self, data: bytes) -> None:
        """data_received on the native path: whole heads parsed by one native call
        (native/vx_reqhead.c), bodies taken by their Content-Length; the callbacks' shared
        parts (_head_complete, on_body, on_message_complete) do the rest exactly as for httptools.
        A head the native parser does not accept sends this connection to httptools for good,
        with every byte not yet consumed."""
        left = self._body_left
        if left:
            n = len(data)
            if n < left:
                self._body_left = left - n
                self.on_body(data)
                return
            self._body_left = 0
            self.on_body(data if n == left else data[:left])
            self.on_message_complete(self._method, self._keep_alive)
            if n == left or self.refused:
                return
            data = data[left:]
            if not self._keep_alive:
                self._after_close = True  # as below: llhttp takes only empty lines after it
        if self._after_close:
            self._data_after_close(data)
            return
        buf = self._buf + data if self._buf else data
        end = len(buf)
        pos = 0
        max_header = self.state.max_header
        while True:
            head = _reqhead(buf, pos, max_header, _UPSTREAM_DROP)
            if head is False:
                # httptools starts the deadline (on_message_begin) unless it already runs;
                # it skips empty lines between requests without starting one.
                self._buf = b""
                self._native = False
                self._feed(buf[pos:] if pos else buf)
                return
            if not self.receiving_since:
                self.receiving_since = time.monotonic()  # the first byte of a request
            if head is None:
                self._buf = buf[pos:] if pos else buf
                return
            # _reset_message, apart from what the head sets just below (and _header_bytes,
            # which only httptools reads and resets in on_message_begin): ~0.4 us a request.
            self._chunks = []
            self._assembled = None
            self._body_size = 0
            self._reject = None
            self._kind = None
            self._caller = None
            (method, self._url, self._headers, length, self._authorization, self._expect,
             keep_alive, self._http10, pos, self._traceparent, self._upstream) = head
            self._method = method
            self._keep_alive = keep_alive
            self._content_length = length
            self._in_body = True
            self._head_complete(method)
            if length > 0:
                have = end - pos
                if have < length:
                    self._buf = b""
                    self._body_left = length - have
                    if have:
                        self.on_body(buf[pos:])
                    return
                self.on_body(buf[pos:pos + length])
                pos += length
            self.on_message_complete(method, keep_alive)
            if self.refused:
                return
            if not keep_alive:
                # llhttp refuses anything but empty lines after such a request.
                self._after_close = True
                self._buf = b""
                if pos < end:
                    self._data_after_close(buf[pos:])
                return
            if pos == end:
                self._buf = b""
                return

    def _data_after_close(self, data: bytes) -> None:
        if data.strip(b"\r\n"):
            self._refuse(BadHTTP("Malformed HTTP request: Data after `Connection: close`"))

    # --- dispatch -------------------------------------------------------------------------

    def _start(self, request: Request, reject: VeloxError | None) -> None:
        self.current = request
        state = self.state
        if reject is not None:
            self.respond_error(request, reject)
        elif state.draining and not state.handoff:
            self.respond_error(request, ShuttingDown())
        elif request.kind <= _ROOT:
            if state.ring.try_push(request):
                if state.reading:
                    state.pushed += 1  # the drain is woken when the read ends
                else:
                    state.wake_drain()
            else:
                state.overloaded += 1
                self.respond_error(request, Overloaded(retry_after_s=1))
        elif request.kind is _HEALTH:
            self.respond(request, 200, _JSON, _HEALTH_BODY)
        elif state.is_ready():
            self.respond(request, 200, _JSON, _READY_BODY)
        else:
            self.respond_error(request, NotReady(retry_after_s=1))

    def _finish(self, keep_alive: bool) -> None:
        self.current = None
        self._streaming = False
        if not keep_alive:
            self.closed = True
            self.transport.close()  # type: ignore[union-attr]
            return
        # The keep-alive timeout counts from here: counted from the request's arrival, an
        # answer longer than the timeout (a slow model, a long stream) left the connection
        # idle "too long" the moment it ended, and the worker's next tick (<= 0.25 s) closed
        # it while the client was sending its next request on it.
        self.last_active = time.monotonic()
        if self._pending and not self.write_paused:
            # (While the client is not reading, the next answer waits for resume_writing:
            # answering requests it keeps pipelining would fill the transport's buffer.)
            self._next()

    def _next(self) -> None:
        """Start the first pipelined request waiting behind the one just answered."""
        pending = self._pending
        if pending:
            nxt, reject = pending.popleft()
            if self.read_paused and len(pending) < _PIPELINE_DEPTH and not self.refused:
                self.read_paused = False
                if self.receiving_since:
                    # A request cut short by the pause gets its full time from now on.
                    self.receiving_since = time.monotonic()
                self.transport.resume_reading()  # type: ignore[union-attr]
            self._start(nxt, reject)

    def _refuse(self, error: VeloxError, method_known: bool = True) -> None:
        """Answer a request we stopped parsing, then close: the parser cannot resync.

        If earlier requests of the connection are still being answered, the refusal waits
        its turn behind them (HTTP/1.1 answers in order) and reading stops meanwhile."""
        if self.closed or self.refused:
            return
        self.refused = True
        self.receiving_since = 0.0
        # A refused HEAD still gets no body. Until llhttp has matched a method it reports its
        # method 0 (DELETE), which is harmless here; an invalid method is no method at all.
        # The native path: the method of the last head parsed (see expire_receive).
        method = self._method if self._native else \
            self.parser.get_method() if method_known else b""
        request = Request(self, method, self._url, Kind.FORWARD, [], b"", False,
                          time.perf_counter_ns(), -1, self.state.ends)
        if self.current is None:
            self._start(request, error)
            return
        if self._pending is None:
            self._pending = deque()
        self._pending.append((request, error))
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    # --- Responder: how the stages answer -------------------------------------------------

    def respond(self, request: Request, status: int, headers: Sequence[tuple[bytes, bytes]],
                body: bytes | memoryview) -> None:
        if request is not self.current or self.closed:
            return
        keep_alive = request.keep_alive and not self.state.draining
        extra = request.extra_headers  # the stages' own headers (keys: x-ratelimit-*)
        if extra:
            headers = [*headers, *extra]
        flags = H1_LENGTH if keep_alive else H1_LENGTH | H1_CLOSE
        if request.method == b"HEAD":
            data = h1write.head(STATUS_LINES[status], headers, len(body), flags)
        elif len(body) <= WHOLE_BYTES:
            # One native call builds the whole response (velox/h1write.py).
            data = h1write.response(STATUS_LINES[status], headers, body, flags)
        else:  # the body is written from itself, as the client takes it
            head = h1write.head(STATUS_LINES[status], headers, len(body), flags)
            # Finished now, not once written: a client that never takes its answer must not
            # hold its body's arena segment or its key's place.
            request.finish(status, len(head) + len(body), request.exchange)
            self._queue(head)
            self._queue(body)
            self._q_done = keep_alive
            self._drain()
            return
        self.transport.write(data)  # type: ignore[union-attr]
        request.finish(status, len(data), request.exchange)
        self._finish(keep_alive)

    def respond_error(self, request: Request, exc: BaseException) -> None:
        if client_api(request.path) != OPENAI:  # the Anthropic SDK reads its own shape
            answer = gateway_error(exc)
            self.respond(request, answer.status, answer.headers, answer.body)
            return
        error = to_response(exc)
        self.respond(request, error.status, error.headers, error.body)

    def start_stream(self, request: Request, status: int,
                     headers: Sequence[tuple[bytes, bytes]]) -> None:
        if request is not self.current or self.closed:
            return
        # HTTP/1.0 has no chunked coding: the end of such a stream is the end of the connection.
        self._chunked = not request.http10
        if not self._chunked:
            request.keep_alive = False
        extra = request.extra_headers
        if extra:
            headers = [*headers, *extra]
        flags = H1_CHUNKED if self._chunked else 0
        if not request.keep_alive or self.state.draining:
            flags |= H1_CLOSE
        request.advance(ANSWERING)
        self._streaming = True
        self._stream_status = status
        self._stream_bytes = 0
        # Written with the first chunks at the end of this loop pass (see send_chunk).
        self._out_head = h1write.head(STATUS_LINES[status], headers, 0, flags)
        self._out = []
        self.state.flush_soon(self)

    def direct_target(self, request: Request) -> tuple[Callable[[bytes], object], bool] | None:
        """Where egress's native HTTP/1.1 reader may write this stream's plain reads itself
        (velox.relay.exchange.Exchange.direct_route): the transport's write and whether the
        answer is chunked. The reader writes only while nothing is queued here (_out, _q
        None, _out_head written), the client reads (write_paused False) and the connection
        is open, and counts its bytes into _stream_bytes, so the answer's bytes stay in order
        and in the access log."""
        if request is not self.current or self.closed or not self._streaming:
            return None
        return self.transport.write, self._chunked  # type: ignore[union-attr]

    def send_chunk(self, data: bytes) -> None:
        """Queue data for the end of this loop pass: every chunk of one upstream read (an SSE
        answer's events often arrive several to a read) is framed by one native call and
        written with one syscall, instead of one write each. The wait is only until the loop
        has dispatched this read's events; backpressure (pause_writing) is seen at that write,
        so at most one upstream read more is taken in before egress withholds credit."""
        if not self._streaming or self.closed or not data:
            return
        out = self._out
        if out is None:
            self._out = [data]
            self.state.flush_soon(self)
        else:
            out.append(data)

    def flush_stream(self) -> None:
        """Write what the stream queued in this loop pass (called by IngressState.flush)."""
        out = self._out
        if out is None or self.closed:
            return
        self._out = None
        if self._q is not None or self.write_paused or not (
                len(out[0]) <= WHOLE_BYTES if len(out) == 1 else _small(out)):
            self._queue_stream(out, False)
            self._drain()
            return
        # _frame inlined for the usual piece (a chunk after the head went): one frame less.
        data = h1write.chunks(out, False) if self._chunked and not self._out_head and out \
            else self._frame(out, False)
        if data:
            self._stream_bytes += len(data)
            self.transport.write(data)  # type: ignore[union-attr]

    def _frame(self, pieces: list[bytes], last: bool) -> bytes:
        if self._chunked:
            data = h1write.chunks(pieces, last) if pieces or last else b""
        else:
            data = b"".join(pieces)
        head = self._out_head
        if head:
            self._out_head = b""
            return head + data
        return data

    def end_stream(self) -> None:
        request = self.current
        if not self._streaming or self.closed or request is None:
            return
        out = self._out or []
        self._out = None
        keep_alive = request.keep_alive and not self.state.draining
        if self._q is not None or self.write_paused or not _small(out):
            self._queue_stream(out, True)
            request.finish(self._stream_status, self._stream_bytes, request.exchange)
            self._q_done = keep_alive
            self._drain()
            return
        # The queued bytes (if any) and the last chunk in one write.
        data = self._frame(out, True)
        self._stream_bytes += len(data)
        self.transport.write(data)  # type: ignore[union-attr]
        request.finish(self._stream_status, self._stream_bytes, request.exchange)
        self._finish(keep_alive)

    # --- the send queue (see "Writing answers" in the module docstring) --------------------

    def _queue(self, data: bytes | memoryview) -> None:
        if not data:
            return
        q = self._q
        if q is None:
            q = self._q = deque()
        q.append(data)
        self._q_bytes += len(data)

    def _queue_stream(self, pieces: list[bytes], last: bool) -> None:
        """A stream's pieces into the send queue, framed around them (each piece its own
        chunk, however large: the piece itself is queued, not a framed copy of it)."""
        head = self._out_head
        if head:
            self._out_head = b""
            self._queue(head)
        size = len(head)
        chunked = self._chunked
        for piece in pieces:
            n = len(piece)
            if not n:
                continue
            if chunked:
                line = b"%x\r\n" % n
                self._queue(line)
                self._queue(piece)
                self._queue(b"\r\n")
                size += len(line) + n + 2
            else:
                self._queue(piece)
                size += n
        if last and chunked:
            self._queue(_LAST_CHUNK)
            size += len(_LAST_CHUNK)
        self._stream_bytes += size

    @property
    def queued(self) -> int:
        """Bytes of answer waiting in the send queue (not yet given to the transport)."""
        return self._q_bytes

    def _drain(self) -> None:
        """Write from the send queue while the transport takes it: slices of the queued
        objects, at most _WRITE_PIECE bytes a write, small neighbours joined into one write.
        pause_writing (called from inside write once the transport's buffer is over its
        high-water mark) stops it; resume_writing goes on. Once the queue is empty, the request
        whose end was queued is finished."""
        q = self._q
        if q is None:
            return
        write = self.transport.write  # type: ignore[union-attr]
        while q and not self.write_paused and not self.closed:
            first = q[0]
            off = self._q_off
            left = len(first) - off
            piece: bytes | memoryview
            if left > _WRITE_PIECE:
                piece = memoryview(first)[off:off + _WRITE_PIECE]
                self._q_off = off + _WRITE_PIECE
            elif off:
                piece = memoryview(first)[off:]
                q.popleft()
                self._q_off = 0
            else:
                parts = [q.popleft()]
                size = left
                while q and size + len(q[0]) <= _WRITE_PIECE:
                    size += len(q[0])
                    parts.append(q.popleft())
                piece = parts[0] if len(parts) == 1 else b"".join(parts)
            self._q_bytes -= len(piece)
            write(piece)
        if q or self.closed:
            return
        self._q = None
        done = self._q_done
        if done is not None:
            self._q_done = None
            self._finish(done)

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._out = None  # queued stream bytes are dropped with the connection
        self._q = None
        # Closing mid-body is the only way HTTP/1.1 can tell the client the response failed.
        self.transport.close()  # type: ignore[union-attr]

    def expire_write(self) -> None:
        """The client took nothing of its answer for VELOX_WRITE_TIMEOUT_MS: the connection is
        aborted, and what it holds (the transport's buffer, the send queue) is dropped now.
        Also after close(), which waits for that buffer to drain."""
        if self.transport is None:
            return
        self.stalled_since = 0.0
        self.state.write_timeouts += 1
        self.closed = True
        self._out = None
        self._q = None
        self.transport.abort()

    def expire_receive(self) -> None:
        """The request being received missed its deadline (VELOX_BODY_TIMEOUT_MS): 408, then
        close. If earlier requests are still being answered, the 408 follows their answers."""
        if self.closed or self.refused:
            return
        if self._native and self._buf:
            # A head still incomplete on the native path: httptools takes it over, so the 408
            # names the method exactly as it would have (what it has matched so far).
            buf, self._buf = self._buf, b""
            self._native = False
            self._feed(buf)
            if self._ended():  # httptools may have refused it meanwhile
                return
        self.receiving_since = 0.0
        self.state.receive_timeouts += 1
        self._refuse(RequestTimeout())

    # --- lifecycle ------------------------------------------------------------------------

    def _ended(self) -> bool:
        return self.closed or self.refused

    @property
    def idle(self) -> bool:
        return self.current is None and not self._pending

    def close_if_idle(self) -> bool:
        if self.current is None and not self._pending and not self.closed:
            self.closed = True
            self.transport.close()  # type: ignore[union-attr]
            return True
        return False


def _x_api_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """A Messages API client's `x-api-key`, as the Authorization value Auth.check reads."""
    for name, value in headers:
        if name == b"x-api-key":
            return b"Bearer " + value
    return None


def _origin_form(target: bytes) -> bytes:
    """An absolute-form target's path and query (`http://h:1/v1/x?q` -> `/v1/x?q`, `http://h`
    -> `/`; RFC 9112 §3.2.2). Its authority must be a valid host[:port], without userinfo
    (RFC 9110 §4.2.4) and not empty (§4.2.1). Any other target (`*`, another scheme) is
    returned as it is, for routing to refuse."""
    match = _ABSOLUTE.fullmatch(target)
    if match is None:
        return target
    authority, rest = match.groups()
    if not authority or _HOST.fullmatch(authority) is None:
        raise _Refuse(BadHTTP(
            f"The request target {target.decode('latin-1')!r} has no valid host[:port]."))
    return rest if rest[:1] == b"/" else b"/" + rest


def _small(pieces: list[bytes]) -> bool:
    """A loop pass's stream pieces fit one ordinary write (framed by one native call)."""
    if len(pieces) == 1:
        return len(pieces[0]) <= WHOLE_BYTES
    return sum(map(len, pieces)) <= WHOLE_BYTES


_CHUNKED_CODING = b"chunked"


def _check_transfer_coding(value: bytes) -> None:
    """Only `chunked` is understood; any other coding (gzip, deflate, identity...) gets 501
    (RFC 9112 §6.1) instead of being silently ignored."""
    for part in value.split(b","):
        coding = part.strip().lower()
        if coding and coding != _CHUNKED_CODING:
            raise _Refuse(UnsupportedTransferCoding(
                f"Transfer-Encoding {coding.decode('latin-1')!r} is not supported; "
                "send the body as is or with chunked only."))
