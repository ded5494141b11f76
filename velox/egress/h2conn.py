"""One multiplexed HTTP/2 upstream connection: the asyncio shell around a sans-IO codec.

All protocol work happens in the codec (`codec.py` and its implementations); this class only
moves bytes between the codec and the transport and turns the codec's events into calls on the
client of each stream's `UpstreamCall`. Requests of one micro-batch are encoded into the codec's
buffer and written with one `transport.write` when the pool flushes, which is where batching
pays off in Python (one TLS record and one syscall for many requests).

With the native codec, reads arrive in C (the `H2Reader` base) and a streamed answer the relay
passes through untouched is *directed* once its head is in (`_direct`): the codec writes its
plain DATA to the client itself, one write per read, and credits the window as the Python path
would (or withholds the credit on the attempt when the write paused the client). Only the head,
the end, resets and the reads the direct path leaves (usage chunks, half events, a paused
client) come here as events; `_release` undirects.

Liveness (`check_liveness`, `request_timed_out`) is driven by the pool's sweep: see h2pool.

States move by one transition table (`TRANSITIONS`, as h2's connection state machine): a
(state, input) pair not in it is a bug, which raises `ConnectionStateError` and leaves the
connection CLOSED.

    CONNECTING --CONNECTED--> WARMING --WARMED--> READY
    WARMING | READY --RETIRE / GOAWAY--> DRAINING (no new streams; closes once they are done)
    any but CLOSED --LOST--> CLOSED;  CONNECTING --NO_H2--> CLOSED (ALPN chose HTTP/1.1)

Every way a stream ends goes through `_release` (end of response, trailers, reset, GOAWAY,
cancel, deadline, connection loss), which is the one place that gives back the flow-control
credit its attempt withholds for a client that stopped reading, and that ends a direct path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sized
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Any, Protocol

from velox.core.errors import UpstreamProtocolError, UpstreamTimeout, UpstreamUnavailable
from velox.egress import codec as ev
from velox.egress.interfaces import UpstreamCall
from velox.egress.nativecodec import H2Reader

if TYPE_CHECKING:
    from velox.egress.interfaces import CallHandle, Client, Front, Headers, Tally

log = logging.getLogger("velox.egress")

# Bytes handed to the transport per loop pass. TLS encrypts inside transport.write, so one
# large upload written at once would hold the loop for many milliseconds; in slices of this
# size it costs a fraction of a millisecond per pass and other requests keep moving.
WRITE_SLICE = 256 * 1024
# A connection with more than this still queued is skipped by the pool when another can take
# the request, so small calls do not wait behind a large upload's bytes.
BACKLOG_LIMIT = 1024 * 1024
# Reads land in a per-connection buffer of this size (BufferedProtocol; the C base's). With a
# plain Protocol, uvloop's TLS layer allocates a fresh 256 KiB bytes object for every read and
# shrinks it, which costs three syscalls (mmap, mremap, munmap) per response.
READ_BUFFER = 256 * 1024
# Requests in a row on one connection that get no response headers within the request timeout
# before the connection is retired: one slow model is normal, three in a row with no response
# in between says the connection (or the upstream behind it) is stuck.
TIMEOUTS_TO_RETIRE = 3
_ANSWER = ev.ANSWER
# Stream ids are 31-bit; retire the connection well before they run out.
_STREAM_ID_LIMIT = (1 << 31) - 1 - 2 * 65_536
_LAST_STREAM_ID = _STREAM_ID_LIMIT - 2  # client ids go up by 2


class State(IntEnum):
    CONNECTING = 0
    WARMING = 1
    READY = 2
    DRAINING = 3
    CLOSED = 4


# Member lookups on an Enum class go through EnumType.__getattr__'s slow attribute path on
# Python 3.11 (~0.25 us each, 12x a module global): the hot paths compare against these.
_READY = State.READY
_DRAINING = State.DRAINING
_CLOSED = State.CLOSED


class Input(Enum):
    CONNECTED = "connected"  # transport up, h2 negotiated (or prior knowledge), preface sent
    NO_H2 = "no_h2"  # ALPN chose something else
    WARMED = "warmed"  # the warm-up request was answered
    RETIRE = "retire"  # we stop using it (stream ids running out, codec refuses streams)
    GOAWAY = "goaway"  # the peer stops taking streams
    LOST = "lost"  # transport gone, protocol error, or closed by us


TRANSITIONS: dict[tuple[State, Input], State] = {
    (State.CONNECTING, Input.CONNECTED): State.WARMING,
    (State.CONNECTING, Input.NO_H2): State.CLOSED,
    (State.CONNECTING, Input.LOST): State.CLOSED,
    (State.WARMING, Input.WARMED): State.READY,
    (State.WARMING, Input.RETIRE): State.DRAINING,
    (State.WARMING, Input.GOAWAY): State.DRAINING,
    (State.WARMING, Input.LOST): State.CLOSED,
    (State.READY, Input.RETIRE): State.DRAINING,
    (State.READY, Input.GOAWAY): State.DRAINING,
    (State.READY, Input.LOST): State.CLOSED,
    (State.DRAINING, Input.RETIRE): State.DRAINING,
    (State.DRAINING, Input.GOAWAY): State.DRAINING,  # a second GOAWAY lowering last_stream_id
    (State.DRAINING, Input.LOST): State.CLOSED,
}


class ConnectionStateError(RuntimeError):
    """An input the connection's state does not allow: a bug in the caller."""


def next_state(state: State, event: Input) -> State:
    """The state `event` moves `state` to; raises ConnectionStateError if the table has no entry."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise ConnectionStateError(f"{event.name} is not allowed in state {state.name}") from None


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

    def warmup_attempt(self, client: Client) -> UpstreamCall:
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


class H2Connection(H2Reader, asyncio.BufferedProtocol):
    """The connection. Its reads arrive in C (nativecodec.H2Reader: get_buffer,
    buffer_updated, `read_buffer`, `codec` and `reads` are C's): with the native codec a read
    whose DATA all went to clients from C (the direct path) and that left nothing to send never
    enters Python; any other read comes to `_h_events` in one call. With the Python framer
    every read comes to `data_received`."""

    __slots__ = (
        "pool", "index", "transport", "state", "streams", "active",
        "last_stream_id", "flush_pending", "opened_at", "goaway_received", "receiving",
        "backlog", "backlog_bytes", "write_paused", "drain_scheduled",
        "seen_reads", "quiet_since", "ping_sent_at", "ping_payload", "pings",
        "timeouts", "dead", "receive", "direct",
    )
    codec: ev.Codec  # (the C base's attribute)

    def __init__(self, pool: H2Owner, index: int, codec: ev.Codec) -> None:
        self.pool = pool
        self.index = index
        self.codec = codec
        self.transport: asyncio.Transport | None = None
        self.state = State.CONNECTING
        self.streams: dict[int, UpstreamCall] = {}  # stream id → attempt (the warm-up's included)
        self.active = 0
        self.last_stream_id = -1  # from GOAWAY: streams above it were never processed
        self.flush_pending = False
        self.opened_at = 0.0
        self.goaway_received = False
        self.receiving = False
        self.backlog: deque[memoryview] = deque()  # bytes the codec produced, not yet written
        self.backlog_bytes = 0
        self.write_paused = False
        self.drain_scheduled = False
        # Liveness (check_liveness): reads counted here, compared with the last tick's count.
        self.reads = 0
        self.seen_reads = 0
        self.quiet_since = 0.0  # monotonic time of the tick that last saw new reads
        self.ping_sent_at = 0.0  # monotonic time of the PING awaiting its ACK (0: none)
        self.ping_payload = b""
        self.pings = 0
        self.timeouts = 0  # requests in a row that got no response headers in time
        self.dead = False  # failed a liveness check: reconnect with backoff
        # The native codec can hand a whole short answer as one ANSWER event (codec.ANSWER):
        # one dispatch and no acknowledge call instead of two events per response.
        # Looked up at the first read (bound once).
        self.receive: Callable[[bytes], list[tuple[Any, ...]]] | None = None
        # The native codec writes a streamed answer's plain DATA to its client itself once
        # told where (its `direct`; see _direct): None for the Python codecs.
        self.direct: Callable[..., bool] | None = getattr(codec, "direct", None)

    def _move(self, event: Input) -> None:
        try:
            self.state = next_state(self.state, event)
        except ConnectionStateError:
            self.state = State.CLOSED
            raise

    # --- transport callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.opened_at = self.quiet_since = time.monotonic()
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None and ssl_object.selected_alpn_protocol() != "h2":
            self._move(Input.NO_H2)
            transport.close()
            self.pool.front.on_no_h2()
            return
        self.codec.initiate()
        self._move(Input.CONNECTED)
        self.pool.on_connected(self)
        self.send(self.pool.warmup_attempt(_Warmup(self)))
        self.flush()

    def data_received(self, data: bytes) -> None:
        """A read, with a codec other than the native one (whose reads C takes)."""
        self.reads += 1  # one increment per read, not per frame: all liveness costs here
        codec = self.codec
        receive = self.receive
        if receive is None:
            receive = self.receive = getattr(codec, "receive_answers", None) or codec.receive_data
        try:
            events = receive(data)
        except ev.CodecError as exc:
            self._h_failed(exc)
            return
        self._h_events(events)

    def _h_failed(self, exc: ev.CodecError) -> None:
        """The read broke the protocol: the codec queued a GOAWAY; the connection goes."""
        log.warning("upstream connection %d: protocol error: %s", self.index, exc)
        self.flush()
        self._fail(UpstreamProtocolError(f"upstream HTTP/2 protocol error: {exc}"))

    def _h_events(self, events: list[tuple[Any, ...]]) -> None:
        """One read's events to the streams' clients; then what the codec queued goes out."""
        codec = self.codec
        streams = self.streams
        now = time.monotonic()
        self.receiving = True
        for event in events:
            kind = event[0]
            if kind == _ANSWER:  # headers and the body's last frame: the common short answer
                attempt = streams.get(event[1])
                if attempt is None:
                    continue  # a stream we reset (the codec credited the connection)
                attempt.t_headers = time.perf_counter_ns()
                attempt.last_activity = now
                self.timeouts = 0
                if attempt.withheld or self.state is not _READY or self.pool.waiting:
                    self._release(attempt)
                else:  # _release with nothing to give back and nobody waiting
                    del streams[attempt.stream_id]
                    self.active -= 1
                    attempt.conn = None
                attempt.client.on_answer(event[2], event[3], event[4])
            elif kind == ev.DATA:
                sid = event[1]
                attempt = streams.get(sid)
                if attempt is None:
                    codec.acknowledge(sid, event[3])  # a stream we reset: credit the connection
                    continue
                attempt.last_activity = now
                client = attempt.client
                if event[4]:
                    self._release(attempt)
                    codec.acknowledge(sid, event[3])
                    client.on_data(event[2], True)
                else:
                    client.on_data(event[2], False)
                    # Checked after on_data, which may be what filled the client's buffer;
                    # credit goes straight back if the attempt ended meanwhile.
                    if attempt.conn is self and client.paused:
                        attempt.withheld += event[3]
                    else:
                        codec.acknowledge(sid, event[3])
            elif kind == ev.RESPONSE:
                attempt = streams.get(event[1])
                if attempt is None:
                    continue
                attempt.t_headers = time.perf_counter_ns()
                attempt.last_activity = now
                self.timeouts = 0
                end = event[4]
                if end:
                    self._release(attempt)
                attempt.client.on_response(event[2], event[3], end)
                if not end and self.direct is not None:
                    self._direct(attempt)
            else:
                self._control(event)
        self.receiving = False
        # The native codec says whether the read left anything to send (an answer's read
        # seldom does: credit goes back in large WINDOW_UPDATEs): no flush call otherwise.
        if not self.flush_pending and getattr(codec, "has_output", True):
            self.flush()

    def _direct(self, attempt: UpstreamCall) -> None:
        """A stream the relay passes through untouched: from here on the codec writes its plain
        DATA to the client itself (velox._native.H2Client.direct: one write per read, no
        event), and its flow-control credit; the rest still comes here as events."""
        client = attempt.client
        route = getattr(client, "direct_route", None)
        if route is None or attempt.conn is not self:
            return
        target = route()
        if target is not None:
            conn, write, sse, chunked = target
            self.direct(attempt.stream_id, conn, write, sse,  # type: ignore[misc]
                        client, attempt, chunked)

    def _control(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == ev.TRAILERS:
            attempt = self.streams.get(event[1])
            if attempt is not None:
                self._release(attempt)
                attempt.client.on_data(b"", True)
        elif kind == ev.RESET:
            attempt = self.streams.get(event[1])
            if attempt is not None:
                self._release(attempt)
                if event[2] == ev.REFUSED_STREAM and self.pool.front.retry(attempt):
                    return
                attempt.client.on_error(UpstreamProtocolError(
                    f"the upstream reset the stream (HTTP/2 error code {event[2]})"))
        elif kind == ev.GOAWAY:
            self._goaway(event[1], event[2])
        elif kind == ev.SETTINGS:
            self.pool.on_capacity(self)
        elif kind == ev.PING_ACK and event[1] == self.ping_payload:
            self.ping_sent_at = 0.0

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(UpstreamUnavailable("the upstream connection was lost"))

    # --- used by the pool ---------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        if self.state is not _READY:
            return 0
        return self.codec.max_concurrent_streams - self.active

    def send(self, attempt: UpstreamCall) -> None:
        """Encode the request into the codec's buffer; the pool flushes once per batch."""
        client = attempt.client
        try:
            stream_id = self.codec.send_request(client.method, client.path, client.headers_out,
                                                client.body or None)
        except ev.CodecError:
            # The codec opens no more streams here (GOAWAY seen or sent); nothing was sent, so
            # the request can go to another connection.
            self.retire()
            if not self.pool.front.retry(attempt):
                client.on_error(UpstreamUnavailable(
                    "no upstream connection could take the request"))
            return
        self.streams[stream_id] = attempt
        self.active += 1
        attempt.conn = self
        attempt.stream_id = stream_id
        attempt.t_sent = time.perf_counter_ns()
        if stream_id >= _LAST_STREAM_ID:  # the next id would reach the limit
            self.retire()

    def flush(self) -> None:
        self.flush_pending = False
        data = self.codec.data_to_send()
        if not data or self.transport is None or self.state is _CLOSED:
            return
        if not self.backlog_bytes and not self.write_paused and len(data) <= WRITE_SLICE:
            self.transport.write(data)  # the common case: one write for the whole batch
            if self.codec.data_pending:
                self.pool.mark_dirty(self)  # more of a large body, on the next loop pass
            return
        self.backlog.append(memoryview(data))
        self.backlog_bytes += len(data)
        self._write_backlog()

    def _write_backlog(self) -> None:
        """Write one slice of the backlog; continue on the next loop pass or on resume."""
        self.drain_scheduled = False
        if self.write_paused or self.transport is None or self.state is _CLOSED:
            return
        budget = WRITE_SLICE
        backlog = self.backlog
        while backlog and budget > 0:
            piece = backlog[0]
            if len(piece) > budget:
                backlog[0] = piece[budget:]
                piece = piece[:budget]
            else:
                backlog.popleft()
            self.transport.write(piece)
            budget -= len(piece)
            self.backlog_bytes -= len(piece)
        if backlog and not self.write_paused and not self.drain_scheduled:
            self.drain_scheduled = True
            self.pool.loop.call_soon(self._write_backlog)
        elif not backlog:
            if self.codec.data_pending:
                # Frame the next part of a large body only now that the last part is out:
                # what the connection buffers stays bounded, and no pass copies much.
                self.pool.mark_dirty(self)
            elif self.pool.waiting:
                self.pool.on_capacity(self)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.backlog:
            self._write_backlog()

    # --- Carrier: called through the attempt ----------------------------------------------------

    def credit(self, attempt: UpstreamCall) -> None:
        """The attempt's client reads again: give the upstream back what it withheld."""
        if attempt.conn is self and attempt.withheld:
            n, attempt.withheld = attempt.withheld, 0
            self.codec.acknowledge(attempt.stream_id, n)
            if not self.receiving:  # inside data_received the frames go out with its own flush
                self.pool.mark_dirty(self)

    def cancel(self, attempt: UpstreamCall) -> None:
        """Abandon the attempt (client gone, deadline, retried elsewhere): reset the stream now
        so the upstream stops generating (and billing)."""
        if attempt.conn is not self:
            return
        if self.state is not _CLOSED:  # (on a closed one nothing is left to stop)
            self.codec.reset_stream(attempt.stream_id)
            self.pool.mark_dirty(self)
            self.pool.tally.cancelled()
        self._release(attempt)

    # --- lifecycle ------------------------------------------------------------------------------

    def retire(self) -> None:
        """Take no new streams; close once the open ones are done (the pool replaces us)."""
        if self.state is State.CLOSED:
            return
        was = self.state
        self._move(Input.RETIRE)
        if was is not State.DRAINING:
            self.pool.on_draining(self)
        if not self.streams:
            self.close()

    def close(self) -> None:
        """Say GOAWAY and close the transport; connection_lost then closes the state."""
        transport = self.transport
        if self.state is State.CLOSED or transport is None or transport.is_closing():
            return  # closed already, or closing (a drained GOAWAY and a retire both close)
        self.codec.close()
        self.flush()
        transport.close()

    # --- internals ------------------------------------------------------------------------------

    def _release(self, attempt: UpstreamCall) -> None:
        """The one exit of a stream: forget it and return the credit its attempt withheld."""
        del self.streams[attempt.stream_id]
        self.active -= 1
        attempt.conn = None
        if self.direct is not None:
            self.codec.undirect(attempt.stream_id)  # type: ignore[attr-defined]
        if attempt.withheld:
            n, attempt.withheld = attempt.withheld, 0
            if self.state is not _CLOSED:
                # The connection window must be credited even for a stream that is over.
                self.codec.acknowledge(attempt.stream_id, n)
                if not self.receiving:
                    self.pool.mark_dirty(self)
        if self.state is _DRAINING:
            if not self.streams:
                self.close()
        elif self.pool.waiting and self.state is _READY:
            self.pool.on_capacity(self)

    def check_liveness(self, now: float, tick_s: float, interval_s: float,
                       timeout_s: float) -> None:
        """Notice a silent upstream: TCP open, nothing coming back (called every pool tick).

        A connection with open streams that read nothing for a tick, or an idle one quiet for
        `interval_s`, is sent a PING; any HTTP/2 peer answers it from its protocol stack,
        however slow its model is. No ACK within `timeout_s` and the connection is failed (its
        open requests get 502) and replaced with backoff.
        """
        if self.state is State.CLOSED or self.state is State.CONNECTING:
            return
        if self.reads != self.seen_reads:
            self.seen_reads = self.reads
            self.quiet_since = now
        if self.ping_sent_at:
            if now - self.ping_sent_at >= timeout_s:
                self._declare_dead(timeout_s)
        elif ((self.active and now - self.quiet_since >= tick_s)
              or now - self.quiet_since >= interval_s):
            self.pings += 1
            self.ping_payload = self.pings.to_bytes(8, "big")
            self.ping_sent_at = now
            self.codec.send_ping(self.ping_payload)
            self.pool.mark_dirty(self)

    def _declare_dead(self, timeout_s: float) -> None:
        log.warning("upstream connection %d: no answer to a PING within %d ms "
                    "(VELOX_UPSTREAM_PING_TIMEOUT_MS) with %d stream(s) open; replacing it",
                    self.index, round(timeout_s * 1000), self.active)
        self.pool.tally.ping_timeout()
        self.dead = True
        self._fail(UpstreamUnavailable("the upstream connection stopped answering"))

    def request_timed_out(self) -> None:
        """A request on this connection got no response headers in time (called by the pool).

        One slow model is no reason to act; `TIMEOUTS_TO_RETIRE` in a row with no response
        in between is: new requests go to a fresh connection while these streams finish.
        """
        self.timeouts += 1
        if self.timeouts >= TIMEOUTS_TO_RETIRE and self.state is State.READY:
            log.warning("upstream connection %d: %d requests in a row got no response "
                        "headers in time; retiring it", self.index, self.timeouts)
            self.pool.tally.timeout_retirement()
            self.retire()

    def warmed(self) -> None:
        if self.state is State.WARMING:
            self._move(Input.WARMED)
            self.pool.on_ready(self)

    def _goaway(self, last_stream_id: int, error_code: int) -> None:
        self.goaway_received = True
        self.last_stream_id = last_stream_id
        self.pool.tally.goaway()
        if error_code:
            log.warning("upstream connection %d: GOAWAY error code %d", self.index, error_code)
        # Stop taking streams first, so the retries below go to another connection.
        was = self.state
        self._move(Input.GOAWAY)
        if was is not State.DRAINING:
            self.pool.on_draining(self)
        # Streams above last_stream_id were never processed: they may safely go elsewhere.
        for attempt in [a for s, a in self.streams.items() if s > last_stream_id]:
            self._release(attempt)
            if not self.pool.front.retry(attempt):
                attempt.client.on_error(
                    UpstreamUnavailable("the upstream refused the request (GOAWAY)"))
        if not self.streams and self.state is not State.CLOSED:
            self.close()

    def _fail(self, exc: Exception) -> None:
        if self.state is State.CLOSED:
            return
        was_ready = self.state >= State.READY
        self._move(Input.LOST)
        attempts = list(self.streams.values())
        for attempt in attempts:
            self._release(attempt)
        for attempt in attempts:
            unprocessed = self.goaway_received and attempt.stream_id > self.last_stream_id
            if unprocessed and self.pool.front.retry(attempt):
                continue
            attempt.client.on_error(exc)
        if self.transport is not None:
            self.transport.abort()
        self.pool.on_closed(self, was_ready and not self.dead)  # dead: back off, not at once


class _Warmup:
    """The warm-up request (a `Client`): any complete answer proves the connection works."""

    __slots__ = ("conn", "attempt", "status", "method", "path", "headers_out", "body")

    def __init__(self, conn: H2Connection) -> None:
        self.conn = conn
        self.attempt: CallHandle | None = None
        self.status = 0
        self.method = b"GET"
        self.path = conn.pool.warmup_path
        self.headers_out: Headers = conn.pool.warmup_headers
        self.body = b""

    @property
    def paused(self) -> bool:
        return False

    def on_response(self, status: int, headers: Headers, end_stream: bool) -> None:
        self.status = status
        if end_stream:
            self.conn.warmed()

    def on_data(self, data: bytes, end_stream: bool) -> None:
        if end_stream:
            self.conn.warmed()

    def on_answer(self, status: int, headers: Headers, body: bytes) -> None:
        self.status = status
        self.conn.warmed()

    def on_error(self, exc: BaseException) -> None:
        conn = self.conn
        if isinstance(exc, UpstreamTimeout) and conn.state is State.WARMING:
            conn.pool.warmup_expired(f"upstream connection {conn.index}")
            # Closed as never ready: the pool reconnects with backoff.
            conn._fail(UpstreamTimeout("the upstream did not answer the warm-up request"))
        else:  # the connection was lost or refused the stream: on_closed reconnects
            conn.pool.went_down(f"upstream connection {conn.index}: warm-up failed: {exc}")
