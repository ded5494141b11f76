"""Relay: carry one upstream response back to its client, streamed or whole.

An `Exchange` is created by the worker for every admitted request and handed to the egress
front of its upstream (an `egress.interfaces.Client`), which reports the upstream's response
through it (`on_response`, `on_data`, `on_error`) and points it at the current attempt.
Server-sent events (any `text/event-stream` response) are relayed chunk by chunk as each
upstream DATA frame arrives: no buffering, `data: [DONE]` passed through untouched. Other
responses are short JSON documents, so they are collected and sent with one write and a
Content-Length, unless they grow past `_BUFFER_LIMIT`, in which case they are streamed too.

Backpressure runs end to end: a streaming client that stops reading pauses our writes to it,
and while it is paused egress stops crediting the upstream's HTTP/2 flow-control window (the
attempt withholds it; `paused` is what egress asks), so the upstream slows down instead of our
memory growing. A client that disconnects cancels the
upstream stream (RST_STREAM) at once, so no tokens are paid for after the user has left.

An exchange of a cached route has an `observer` (the `Observer` protocol below; velox.cache.front):
it sees the committed answer's head, each piece of its body as the upstream sent it and the
end, to record it and to serve the identical requests waiting for it; while any wait, the
client leaving does not cancel the call. On other routes the slot is None (one test per event).


Token accounting (velox.relay.usage): an exchange may carry a `meter` (None for requests nobody
accounts, which pay one attribute test per call). The relay tells it where the answer starts,
hands it every streamed piece (it returns what the client gets: the usage chunk the gateway asked
for on the client's behalf is removed there), the whole body of a plain answer, and, exactly once
and before the route attempt is finished, that the request is over, whatever ended it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from velox.core.errors import to_response
from velox.core.types import Headers, Request
from velox.ingress import h1write
from velox.ingress.headers import PLAIN_CONNECTION, connection_tokens
from velox.relay.usage import SSEUsage

if TYPE_CHECKING:
    from velox.config.tables import RouteSpec, UpstreamSpec
    from velox.egress.edge import Translation
    from velox.egress.interfaces import CallHandle
    from velox.providers.base import Translator
    from velox.relay.usage import Meter

# Response headers that describe the upstream connection, not the response (RFC 9110 §7.6.1),
# plus content-length, which ingress writes from the bytes it actually sends. The fields an
# upstream's Connection header names are hop-by-hop too and are dropped as well (answer_head),
# whichever protocol brought them: HTTP/1.1 upstreams name their own there, and HTTP/2 ones
# must not send the field at all (RFC 9113 §8.2.2). With the framer and native codecs such an
# HTTP/2 response is accepted and stripped here (the check costs nothing on answers without a
# Connection field); the h2/jh2 codecs validate headers themselves and treat it as a protocol
# error (502).
_DROP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade",
    b"te", b"trailer", b"content-length", b"proxy-authenticate", b"alt-svc",
})
_EVENT_STREAM = b"text/event-stream"
# A request answered with its gateway key's own x-ratelimit-* headers (velox.admission.keys, in
# request.extra_headers) does not also get the provider's: they describe the gateway's
# account with the provider, not the key's limits.
_DROP_KEYED = _DROP | frozenset({
    b"x-ratelimit-limit-requests", b"x-ratelimit-remaining-requests",
    b"x-ratelimit-reset-requests", b"x-ratelimit-limit-tokens",
    b"x-ratelimit-remaining-tokens", b"x-ratelimit-reset-tokens",
})
# Non-streaming bodies larger than this are relayed as they arrive instead of collected.
_BUFFER_LIMIT = 1 << 20


class Exchange:
    """One client request's round trip through the upstream (an egress `Client`).

    The exchange is the client side only: egress keeps its own record of each try
    (`attempt`, replaced when the request is sent again), and this class never assumes one
    connection for its life: it cancels or resumes whichever attempt is current.
    """

    __slots__ = (
        "request", "conn", "method", "path", "headers_out", "body", "attempt", "on_done",
        "status", "headers", "chunks", "size", "streaming", "sse", "tail", "started",
        "finished",
        "t_sent", "t_headers",
        # failover (velox.routing.dispatch) and routing's state of this request (its plan, the
        # attempt open, the last one's upstream and number, the outcome): UNROUTED until planned
        "dispatch", "routing",
        "headers_base", "passthrough",
        "extra",  # headers added to the answer (dispatch: x-velox-upstream, x-velox-attempts)
        "observer",  # cache (velox.cache.front): sees the committed answer; None on uncached routes
        "meter",  # velox.relay.usage: token accounting, None when nobody accounts this request
        # velox.egress.edge.Translation: the attempt's target speaks another API than the
        # client's; None when the answer is relayed as it is (OpenAI and Azure upstreams)
        "edge",
        # A stream whose pieces only the meter's event reader sees (no cache, no translation):
        # that reader's feed, called per piece without the layers in between; else None.
        "feed",
        # The answer's x-request-id (the upstream's), found by the head's filter: the ledger
        # row and the access record read it here instead of searching the headers again.
        "request_id",
    )

    # The Anthropic Messages API in front (velox.relay.messages.MessagesExchange) shapes each
    # attempt for its target: dispatch asks only when this is True.
    front = False

    def target(self, spec: UpstreamSpec, model: str, credential: Headers,
               translator: Translator | None = None) -> bool:
        """Shape this attempt for its target (only the Messages front does: see `front`);
        False when the gateway answered instead."""
        return True

    def __init__(self, request: Request, path: bytes, headers_out: Headers,
                 on_done: Callable[[Exchange, int], None],
                 dispatch: Failover | None = None) -> None:
        self.request = request
        self.conn = request.conn
        self.method = request.method
        self.path = path  # upstream path (dispatch sets it per attempt)
        self.headers_out = headers_out  # upstream headers (hop-by-hop dropped, auth applied)
        self.body: bytes | bytearray | memoryview = request.body  # per attempt: model rewritten
        request.exchange = self
        self.dispatch = dispatch
        # velox.routing.balance.RoutePlan, set by dispatch; never None, so its readers (the
        # meters, the spend, once per request each) test no None first
        self.routing: RouteState = UNROUTED
        self.headers_base: Headers = headers_out  # the client's headers without credentials
        self.passthrough: Headers = []  # the client's credential, when the upstream has none
        self.attempt: CallHandle | None = None  # egress's current try; set by egress
        self.on_done = on_done  # (exchange, status) once the client has its full answer
        self.status = 0
        self.headers: Headers = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.streaming = False
        self.sse = False  # the response is text/event-stream
        self.tail = b""  # the last two bytes streamed: b"\n\n" ends an event
        self.started = False  # response head sent to the client
        self.finished = False
        self.t_sent = 0  # of the attempt that answered (perf_counter_ns)
        self.t_headers = 0
        self.extra: tuple[tuple[bytes, bytes], ...] = ()
        self.observer: Observer | None = None
        self.meter: Meter | None = None
        self.edge: Translation | None = None
        self.feed: Callable[[bytes], bytes] | None = None
        self.request_id: bytes | None = None

    # --- what the request carries upstream ------------------------------------------------

    # What the answer's route was, as the access log's record reads it of whatever answered
    # (velox.relay.records.Logged: an exchange or a batch member): b"" and 0 for an exchange
    # refused before it had a plan.
    @property
    def upstream_name(self) -> bytes:
        return self.routing.upstream_name

    @property
    def attempts(self) -> int:
        return self.routing.attempts

    @property
    def paused(self) -> bool:
        """The client is not reading (its transport paused our writes)."""
        return self.conn.write_paused

    # --- egress → client ------------------------------------------------------------------

    def on_response(self, status: int, headers: Headers, end_stream: bool) -> None:
        if self.finished or not self._commit(status, headers):
            return
        if self.sse:
            self._start_streaming()
        if end_stream:
            self._complete()

    def on_answer(self, status: int, headers: Headers, body: bytes) -> None:
        """The whole answer in one piece (egress.interfaces.Client): on_response then
        on_data(body, True), without collecting the body (at most one DATA frame, 16 KiB)."""
        if self.finished or not self._commit(status, headers):
            return
        if self.sse:  # a whole event stream in one read: relayed as a stream all the same
            self._start_streaming()
            self.on_data(body, True)
            return
        if self.edge is not None:
            body = self._translate(body)
        self._begin()
        observer = self.observer
        if observer is not None:
            observer.data(body)
        self.finished = True
        meter = self.meter
        if meter is not None:
            meter.body(body)
        self.started = True
        self.conn.respond(self.request, self.status, self.headers, body)
        self._done(self.status, False, None)

    def _commit(self, status: int, headers: Headers) -> bool:
        """Response headers: False when dispatch sends the request again instead; else they
        are the head of the client's answer (filtered, with server-timing and x-velox-*).
        Nothing reaches the client yet: a plain answer is collected first, and until it goes
        out (`_begin`) a lost connection may still send the request elsewhere."""
        attempt = self.attempt
        if attempt is not None:
            self.t_sent = attempt.t_sent
            self.t_headers = attempt.t_headers
        dispatch = self.dispatch
        if dispatch is not None and dispatch.response(self, status, headers):
            return False  # a failure sent again elsewhere: nothing of it reaches the client
        edge = self.edge
        if edge is not None:  # the head of the answer in the client's API
            headers = edge.head(status, headers)
        out, sse, self.request_id = self._head(headers)
        if sse:
            self.sse = True
        self.status = status
        self.headers = out
        return True

    def _head(self, headers: Headers) -> tuple[Headers, bool, bytes | None]:
        request = self.request
        drop = _DROP if request.extra_headers is None else _DROP_KEYED
        # One native call: the filter, server-timing, the extra headers, the SSE test (the
        # Python writer, h1write.use(False), takes its Python twin).
        return (_relay_head if h1write.server_timing is _NATIVE_TIMING else answer_head)(
            headers, drop, request.t_received, request.t_popped, request.t_parsed,
            request.t_admitted, self.t_sent, self.t_headers, self.extra)

    def _translate(self, body: bytes) -> bytes:
        """A whole answer of a translated attempt, in the client's API: its status, head
        and body replace the upstream's."""
        assert self.edge is not None
        answer = self.edge.answer(self.status, body)
        self.status = answer.status
        self.headers, _, self.request_id = self._head(answer.headers)
        return answer.body

    def _begin(self) -> None:
        """The commit point: the answer starts going to the client. No retry can need the
        request body any more, and the observer (and an event stream's meter) sees the head,
        then the pieces collected so far."""
        self.request.release_body()
        observer = self.observer
        if observer is not None:
            observer.head(self.status, self.headers)
            for chunk in self.chunks:
                observer.data(chunk)
        if self.sse and self.meter is not None:  # a plain answer: nothing for the meter yet
            self.meter.response(self.status, True)

    def on_data(self, data: bytes, end_stream: bool) -> None:
        if self.finished:
            return
        feed = self.feed
        if feed is not None:  # _relay without its layers: the common stream, per event
            data = feed(data)
            if data:
                self.conn.send_chunk(data)
                self.tail = data[-2:] if len(data) > 1 else self.tail[-1:] + data
        elif self.streaming:
            if self.edge is not None:
                data = self.edge.feed(data)  # upstream bytes in, the client's events out
            self._relay(data)
        else:
            self.chunks.append(data)
            self.size += len(data)
            # A translated answer is read whole (its API's JSON is not the client's).
            if self.size > _BUFFER_LIMIT and self.edge is None:
                self._start_streaming()
        if end_stream:
            self._complete()

    def direct_route(self) -> tuple[Any, Callable[[bytes], object], Any, bool] | None:
        """For egress, once the head is in: where a streamed answer's reads may go without
        this exchange, when it would pass them through untouched (no observer, no
        translation; the meter, if any, only reads them: `feed` is an SSEUsage's). Returns
        (the client connection, its transport's write, the SSEUsage or None, chunked) for
        the native HTTP/1.1 reader (velox._native.H1Reader.direct), which checks per read
        that the piece is one the Python path would pass as is; None: keep calling on_data."""
        if not self.streaming or self.finished or self.observer is not None or \
                self.edge is not None:
            return None
        sse = None
        if self.meter is not None:
            sse = getattr(self.feed, "__self__", None)  # the feed is SSEUsage.feed or None
            if type(sse) is not SSEUsage:
                return None
        direct_target = getattr(self.conn, "direct_target", None)  # ingress's HTTP/1.1 only
        target = None if direct_target is None else direct_target(self.request)
        if target is None:
            return None
        write, chunked = target
        return self.conn, write, sse, chunked

    def _relay(self, data: bytes) -> None:
        """One piece of a streamed answer to the client (through the observer and meter)."""
        observer = self.observer
        if observer is not None:
            observer.data(data)
        if self.meter is not None:
            data = self.meter.data(data)
        if data:
            self.conn.send_chunk(data)
            self.tail = data[-2:] if len(data) > 1 else self.tail[-1:] + data

    def on_error(self, exc: BaseException) -> None:
        if self.finished:
            return
        dispatch = self.dispatch
        if dispatch is not None and not self.started and dispatch.error_failed(self, exc):
            return  # nothing reached the client yet: sent again elsewhere
        self.finished = True
        broken = self.started
        if self.sse and self.started and self.tail in (b"", b"\n\n"):
            # Past the commit point: nothing is retried. An event stream that broke between
            # events ends with an OpenAI-shaped error event and without `data: [DONE]`, so the
            # client (the SDK raises APIError) knows the answer is truncated, and the connection
            # stays usable. One that broke inside an event is cut below: an event appended to
            # half a line would be read as part of it.
            self.conn.send_chunk(self.stream_error(exc))
            self.conn.end_stream()
        elif self.started:
            # Part of a plain response is already with the client: all HTTP/1.1 can do is cut
            # the connection, which the client sees as an error rather than a truncation.
            self.conn.abort()
        else:
            self.conn.respond_error(self.request, exc)
        self._done(getattr(exc, "status", 502), broken, exc)

    def stream_error(self, exc: BaseException) -> bytes:
        """The event that ends an event stream broken past the commit point (OpenAI's shape;
        velox.relay.messages writes Anthropic's)."""
        return b"data: %b\n\n" % to_response(exc).body

    def refuse(self, exc: BaseException) -> None:
        """Answer with an error before any attempt was made (no route, no target)."""
        if self.finished:
            return
        self.finished = True
        self.conn.respond_error(self.request, exc)
        self._done(getattr(exc, "status", 502), False, exc)

    def reset_for_retry(self) -> None:
        """Forget the abandoned attempt's answer: the next attempt starts afresh."""
        self.status = 0
        self.headers = []
        self.request_id = None
        self.chunks = []
        self.size = 0
        self.t_sent = self.t_headers = 0

    # --- ingress → egress -----------------------------------------------------------------

    def client_gone(self) -> None:
        if self.finished:
            return
        observer = self.observer
        if observer is not None and observer.client_gone(self):
            # Others wait for this answer: the call runs on (see velox.cache.front), and may
            # still be sent again, so it keeps a copy of the body (the request's end gives the
            # arena segment back; only when a leader leaves its followers).
            request = self.request
            if request.arena_segment >= 0:
                request.body = bytes(request.body)
            return
        self.finished = True
        attempt = self.attempt
        if attempt is not None:
            attempt.cancel()
        self._done(499, False, _CLIENT_GONE)

    def client_writable(self) -> None:
        """The client drains again: the current attempt returns the credit it withheld."""
        attempt = self.attempt
        if attempt is not None and not self.finished:
            attempt.resume()

    # --- internals ------------------------------------------------------------------------

    def _start_streaming(self) -> None:
        self._begin()
        self.streaming = True
        self.started = True
        meter = self.meter
        if meter is not None and self.observer is None and self.edge is None:
            self.feed = meter.stream_feed()
        self.conn.start_stream(self.request, self.status, self.headers)
        if self.chunks:
            meter = self.meter
            for chunk in self.chunks:
                self.conn.send_chunk(chunk if meter is None else meter.data(chunk))
            self.chunks = []

    def _complete(self) -> None:
        self.finished = True
        meter = self.meter
        if self.streaming:
            if self.edge is not None:
                self._relay(self.edge.end())  # [DONE], or an error event if it was cut
            if meter is not None:
                rest = meter.end()
                if rest:
                    self.conn.send_chunk(rest)
            self.conn.end_stream()
        else:
            chunks = self.chunks
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if self.edge is not None:
                body = self._translate(body)
                self.chunks = [body]
            self._begin()
            if meter is not None:
                meter.body(body)
            self.started = True
            self.conn.respond(self.request, self.status, self.headers, body)
        self._done(self.status, False, None)

    def _done(self, status: int, broken: bool, error: BaseException | None) -> None:
        # Request and exchange point at each other, as do exchange and attempt; cutting the
        # links here lets reference counting free them at once instead of leaving cycles for
        # the garbage collector.
        self.request.exchange = None
        self.attempt = None
        if self.meter is not None:
            self.meter.finish(self, status)  # before the route attempt is finished: it settles
        if self.dispatch is not None:
            self.dispatch.finish(self, broken)  # releases the route attempt, reports its outcome
        observer = self.observer
        if observer is not None:
            self.observer = None
            observer.end(error)
        self.on_done(self, status)


def answer_head(headers: Headers, drop: frozenset[bytes], t_received: int, t_popped: int,
                t_parsed: int, t_admitted: int, t_sent: int, t_headers: int,
                extra: tuple[tuple[bytes, bytes], ...]) -> tuple[Headers, bool, bytes | None]:
    """The client's answer head from the upstream's (the native relay_head, in Python: the
    Python writer's path and the reference the native one is tested against): the fields not
    in `drop` and not named by a Connection field, then server-timing, then `extra`; whether
    the first content-type is an event stream; and the first x-request-id kept."""
    listed: set[bytes] | None = None
    sse: bool | None = None
    for name, value in headers:
        if name == b"connection":
            if value.lower() not in PLAIN_CONNECTION:
                listed = connection_tokens(value, listed)
        elif name == b"content-type" and sse is None:
            sse = value.startswith(_EVENT_STREAM)
    out = [h for h in headers if h[0] not in drop and (listed is None or h[0] not in listed)]
    request_id = next((value for name, value in out if name == b"x-request-id"), None)
    out.append((b"server-timing", h1write.py_server_timing(
        t_received, t_popped, t_parsed, t_admitted, t_sent, t_headers)))
    out.extend(extra)
    return out, bool(sse), request_id


class Observer(Protocol):
    """Watches one exchange's committed answer (velox.cache.front records it and serves requests
    waiting for it). Called only for the answer that reaches the client, never for an
    attempt abandoned for a retry; `data` sees the upstream's bytes as they arrive."""

    def head(self, status: int, headers: Headers) -> None:
        """The answer's status and response headers; it may append headers to `headers`."""

    def data(self, data: bytes) -> None:
        """A piece of the body, as the upstream sent it."""

    def end(self, error: BaseException | None) -> None:
        """The exchange is over: None when the answer completed, else why it did not."""

    def client_gone(self, exchange: Exchange) -> bool:
        """The client left: True keeps the upstream call running (others wait for it);
        the observer then points `exchange.conn` somewhere harmless."""


class RouteAttemptView(Protocol):
    """What the relay and the meters read of the attempt open (velox.routing.balance.
    RouteAttempt): its upstream, the model sent there and its route, its row in the targets'
    stats, and the tokens it reserved on that upstream's tpm bucket (the meter settles them)."""

    upstream: int
    tokens: int
    model: str
    index: int

    @property
    def route(self) -> RouteSpec: ...


class RouteState(Protocol):
    """Routing's state of one request (velox.routing.balance.RoutePlan, written by dispatch):
    what the relay, the meters, the spend and the access log read of it."""

    @property
    def attempt(self) -> RouteAttemptView | None:
        """The attempt open now; None once it is finished."""

    @property
    def upstream_name(self) -> bytes:
        """The upstream of the last attempt sent (b"" before any)."""

    @property
    def attempts(self) -> int:
        """The number of the last attempt sent (1 for the first; 0 before any)."""


class _Unrouted:
    """The routing state of an exchange that has no plan (yet, or refused before one)."""

    __slots__ = ()

    attempt: RouteAttemptView | None = None
    upstream_name = b""
    attempts = 0


UNROUTED: RouteState = _Unrouted()


class Failover(Protocol):
    """What the relay asks of routing (velox.routing.dispatch.Dispatch) while nothing of the
    answer has reached the client: whether to send the request again elsewhere instead."""

    def response(self, exchange: Exchange, status: int, headers: Headers) -> bool:
        """Response headers arrived: True when the request goes to another target instead."""

    def error_failed(self, exchange: Exchange, exc: BaseException) -> bool:
        """The attempt failed: True when the request goes to another target instead."""

    def finish(self, exchange: Exchange, broken: bool) -> None:
        """The exchange is over: release the route attempt and report its outcome."""


class ClientGone(Exception):
    """Why an exchange ended when its client disconnected (what Observer.end is told)."""


_CLIENT_GONE = ClientGone("the client disconnected")
_NATIVE_TIMING = h1write.native_server_timing
_relay_head = h1write.relay_head
