"""One multiplexed HTTP/2 upstream connection: the asyncio shell around a sans-IO codec.

All protocol work happens in the codec (`codec.py` and its implementations); this class only
moves bytes between the codec and the transport and turns the codec's events into calls on the
exchange of each stream. Requests of one micro-batch are encoded into the codec's buffer and
written with one `transport.write` when the pool flushes, which is where batching pays off in
Python (one TLS record and one syscall for many requests).

Connection states: CONNECTING → WARMING (preface sent, warm-up request in flight) → READY →
DRAINING (GOAWAY received or retiring: no new streams) → CLOSED.

Imports: egress.codec, errors, stdlib.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from velox.egress import codec as ev
from velox.errors import UpstreamProtocolError, UpstreamTimeout, UpstreamUnavailable

if TYPE_CHECKING:
    from velox.egress.pool import Pool

log = logging.getLogger("velox.egress")

_REFUSED_STREAM = 0x7
# Bytes handed to the transport per loop pass. TLS encrypts inside transport.write, so one
# large upload written at once would hold the loop for many milliseconds; in slices of this
# size it costs a fraction of a millisecond per pass and other requests keep moving.
WRITE_SLICE = 256 * 1024
# A connection with more than this still queued is skipped by the pool when another can take
# the request, so small calls do not wait behind a large upload's bytes.
BACKLOG_LIMIT = 1024 * 1024
# Reads land in this per-connection buffer (BufferedProtocol). With a plain Protocol, uvloop's
# TLS layer allocates a fresh 256 KiB bytes object for every read and shrinks it, which costs
# three syscalls (mmap, mremap, munmap) per response.
READ_BUFFER = 256 * 1024
# Requests in a row on one connection that get no response headers within the request timeout
# before the connection is retired: one slow model is normal, three in a row with no response
# in between says the connection (or the upstream behind it) is stuck.
TIMEOUTS_TO_RETIRE = 3
# Stream ids are 31-bit; retire the connection well before they run out.
_STREAM_ID_LIMIT = (1 << 31) - 1 - 2 * 65_536


class State(IntEnum):
    CONNECTING = 0
    WARMING = 1
    READY = 2
    DRAINING = 3
    CLOSED = 4


class H2Connection(asyncio.BufferedProtocol):
    __slots__ = (
        "read_buffer",
        "pool", "index", "codec", "transport", "state", "streams", "active",
        "last_stream_id", "flush_pending", "opened_at", "goaway_received", "receiving",
        "backlog", "backlog_bytes", "write_paused", "drain_scheduled", "warmup_timer",
        "reads", "seen_reads", "quiet_since", "ping_sent_at", "ping_payload", "pings",
        "liveness_timer", "timeouts", "dead",
    )

    def __init__(self, pool: Pool, index: int, codec: ev.Codec) -> None:
        self.pool = pool
        self.index = index
        self.codec = codec
        self.transport: asyncio.Transport | None = None
        self.state = State.CONNECTING
        self.streams: dict[int, Any] = {}  # stream id → exchange (or the warm-up sink)
        self.active = 0
        self.last_stream_id = -1  # from GOAWAY: streams above it were never processed
        self.flush_pending = False
        self.opened_at = 0.0
        self.goaway_received = False
        self.receiving = False
        self.read_buffer = memoryview(bytearray(READ_BUFFER))
        self.backlog: deque[memoryview] = deque()  # bytes the codec produced, not yet written
        self.backlog_bytes = 0
        self.write_paused = False
        self.drain_scheduled = False
        self.warmup_timer: asyncio.TimerHandle | None = None
        # Liveness (see _liveness): reads counted here, compared with the last tick's count.
        self.reads = 0
        self.seen_reads = 0
        self.quiet_since = 0.0  # monotonic time of the tick that last saw no new reads begin
        self.ping_sent_at = 0.0  # monotonic time of the PING awaiting its ACK (0: none)
        self.ping_payload = b""
        self.pings = 0
        self.liveness_timer: asyncio.TimerHandle | None = None
        self.timeouts = 0  # requests in a row that got no response headers in time
        self.dead = False  # failed a liveness check: reconnect with backoff

    # --- transport callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.opened_at = time.monotonic()
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None and ssl_object.selected_alpn_protocol() != "h2":
            self.state = State.CLOSED
            transport.close()
            self.pool.on_no_h2(self)
            return
        self.codec.initiate()
        self.state = State.WARMING
        self.pool.on_connected(self)
        warmup = _Warmup(self)
        self._open(warmup, b"GET", self.pool.warmup_path, self.pool.warmup_headers, None)
        self.flush()
        # The warm-up has the connect timeout as its deadline: an upstream that accepts HTTP/2
        # but never answers would otherwise leave us WARMING forever (252 s seen), unlogged.
        self.warmup_timer = self.pool.loop.call_later(self.pool.connect_timeout_s,
                                                      self._warmup_expired)
        if self.pool.ping_interval_s:
            self.quiet_since = time.monotonic()
            self.liveness_timer = self.pool.loop.call_later(self.pool.liveness_tick_s,
                                                            self._liveness)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self.read_buffer[:nbytes]))

    def data_received(self, data: bytes) -> None:
        self.reads += 1  # one increment per read, not per frame: all liveness costs here
        try:
            events = self.codec.receive_data(data)
        except ev.CodecError as exc:
            log.warning("upstream connection %d: protocol error: %s", self.index, exc)
            self.flush()
            self._fail(UpstreamProtocolError(f"upstream HTTP/2 protocol error: {exc}"))
            return
        streams = self.streams
        self.receiving = True
        for event in events:
            kind = event[0]
            if kind == ev.DATA:
                sink = streams.get(event[1])
                if sink is None:
                    self.codec.acknowledge(event[1], event[3])
                    continue
                end = event[4]
                if end:
                    self._close_stream(event[1])
                sink.on_data(event[2], end)
                sink.consumed(event[3])
            elif kind == ev.RESPONSE:
                sink = streams.get(event[1])
                if sink is None:
                    continue
                end = event[4]
                self.timeouts = 0
                if end:
                    self._close_stream(event[1])
                sink.on_response(event[2], event[3], end)
            else:
                self._control(event)
        self.receiving = False
        if not self.flush_pending:
            self.flush()

    def _control(self, event: tuple) -> None:
        kind = event[0]
        if kind == ev.TRAILERS:
            sink = self.streams.get(event[1])
            if sink is not None:
                self._close_stream(event[1])
                sink.on_data(b"", True)
        elif kind == ev.RESET:
            sink = self.streams.get(event[1])
            if sink is not None:
                self._close_stream(event[1])
                if event[2] == _REFUSED_STREAM and self.pool.retry(sink):
                    return
                sink.on_error(UpstreamProtocolError(
                    f"the upstream reset the stream (HTTP/2 error code {event[2]})"))
        elif kind == ev.GOAWAY:
            self._goaway(event[1], event[2])
        elif kind == ev.SETTINGS:
            self.pool.on_capacity(self)
        elif kind == ev.PING_ACK:
            if event[1] == self.ping_payload:
                self.ping_sent_at = 0.0

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(UpstreamUnavailable("the upstream connection was lost"))

    # --- used by the pool ---------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        if self.state is not State.READY:
            return 0
        return self.codec.max_concurrent_streams - self.active

    def send(self, exchange: Any) -> None:
        """Encode the request into the codec's buffer; the pool flushes once per batch."""
        request = exchange.request
        self._open(exchange, request.method, exchange.path, exchange.headers_out, request.body)
        if self.codec.next_stream_id >= _STREAM_ID_LIMIT:
            self.retire()

    def _open(self, sink: Any, method: bytes, path: bytes, headers: list, body: Any) -> None:
        try:
            stream_id = self.codec.send_request(method, path, headers, body or None)
        except ev.CodecError:
            # The codec opens no more streams here (GOAWAY seen or sent); nothing was sent, so
            # the request can go to another connection.
            self.retire()
            if not self.pool.retry(sink):
                sink.on_error(UpstreamUnavailable("no upstream connection could take the request"))
            return
        self.streams[stream_id] = sink
        self.active += 1
        sink.link = self
        sink.stream_id = stream_id
        sink.t_sent = time.perf_counter_ns()

    def flush(self) -> None:
        self.flush_pending = False
        data = self.codec.data_to_send()
        if not data or self.transport is None or self.state is State.CLOSED:
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
        if self.write_paused or self.transport is None or self.state is State.CLOSED:
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

    def acknowledge(self, sink: Any, n: int) -> None:
        self.codec.acknowledge(sink.stream_id, n)
        if not self.receiving:  # inside data_received the frames go out with its own flush
            self.pool.mark_dirty(self)

    def pause_for(self, sink: Any) -> None:
        """Nothing to do: withholding flow-control credit is what slows the upstream down."""

    def cancel(self, sink: Any) -> None:
        """The client left: reset the stream now so the upstream stops generating (and billing)."""
        if self.streams.pop(sink.stream_id, None) is not None:
            self.active -= 1
            if self.state is not State.CLOSED:
                self.codec.reset_stream(sink.stream_id)
                self.pool.mark_dirty(self)
                self.pool.streams_cancelled += 1
            self._after_stream()

    def retire(self) -> None:
        """Take no new streams; close once the open ones are done (the pool replaces us)."""
        if self.state < State.DRAINING:
            self.state = State.DRAINING
            self.pool.on_draining(self)
        if not self.streams:
            self.close()

    def close(self) -> None:
        if self.state is State.CLOSED:
            return
        if self.transport is not None:
            self.codec.close()
            self.flush()
            self.transport.close()

    # --- internals ------------------------------------------------------------------------------

    def _close_stream(self, stream_id: int) -> None:
        del self.streams[stream_id]
        self.active -= 1
        self._after_stream()

    def _after_stream(self) -> None:
        if self.state is State.DRAINING:
            if not self.streams:
                self.close()
        elif self.pool.waiting:
            self.pool.on_capacity(self)

    def _liveness(self) -> None:
        """Notice a silent upstream (finding 3): TCP open, nothing coming back.

        Every tick (at most 1 s): a connection with open streams that read nothing since the
        last tick, or an idle one quiet for VELOX_UPSTREAM_PING_INTERVAL_MS, is sent a PING;
        any HTTP/2 peer answers it from its protocol stack, however slow its model is. No ACK
        within VELOX_UPSTREAM_PING_TIMEOUT_MS and the connection is failed and replaced.
        """
        self.liveness_timer = None
        if self.state is State.CLOSED:
            return
        pool = self.pool
        now = time.monotonic()
        if self.reads != self.seen_reads:
            self.seen_reads = self.reads
            self.quiet_since = now
        if self.ping_sent_at:
            if now - self.ping_sent_at >= pool.ping_timeout_s:
                self._declare_dead()
                return
        elif ((self.active and now - self.quiet_since >= pool.liveness_tick_s)
              or now - self.quiet_since >= pool.ping_interval_s):
            self.pings += 1
            self.ping_payload = self.pings.to_bytes(8, "big")
            self.ping_sent_at = now
            self.codec.send_ping(self.ping_payload)
            pool.mark_dirty(self)
        self.liveness_timer = pool.loop.call_later(pool.liveness_tick_s, self._liveness)

    def _declare_dead(self) -> None:
        log.warning("upstream connection %d: no answer to a PING within %d ms "
                    "(VELOX_UPSTREAM_PING_TIMEOUT_MS) with %d stream(s) open; replacing it",
                    self.index, self.pool.settings.upstream_ping_timeout_ms, self.active)
        self.pool.ping_timeouts += 1
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
            self.pool.timeout_retirements += 1
            self.retire()

    def _warmup_expired(self) -> None:
        self.warmup_timer = None
        if self.state is not State.WARMING:
            return
        log.warning("upstream connection %d: no answer to the warm-up request GET %s within "
                    "%d ms (VELOX_CONNECT_TIMEOUT_MS); reconnecting", self.index,
                    self.pool.warmup_path.decode(), self.pool.settings.connect_timeout_ms)
        self.pool.warmup_timeouts += 1
        self.streams.clear()  # only the warm-up's stream is open while WARMING: no 2nd log line
        self.active = 0
        # _fail closes us and the pool reconnects with backoff (the connection never was ready).
        self._fail(UpstreamTimeout("the upstream did not answer the warm-up request"))

    def warmed(self) -> None:
        if self.warmup_timer is not None:
            self.warmup_timer.cancel()
            self.warmup_timer = None
        if self.state is State.WARMING:
            self.state = State.READY
            self.pool.on_ready(self)

    def _goaway(self, last_stream_id: int, error_code: int) -> None:
        self.goaway_received = True
        self.last_stream_id = last_stream_id
        self.pool.goaways += 1
        if error_code:
            log.warning("upstream connection %d: GOAWAY error code %d", self.index, error_code)
        # Stop taking streams first, so the retries below go to another connection.
        if self.state < State.DRAINING:
            self.state = State.DRAINING
            self.pool.on_draining(self)
        # Streams above last_stream_id were never processed: they may safely go elsewhere.
        for stream_id in [s for s in self.streams if s > last_stream_id]:
            sink = self.streams.pop(stream_id)
            self.active -= 1
            if not self.pool.retry(sink):
                sink.on_error(UpstreamUnavailable("the upstream refused the request (GOAWAY)"))
        self.retire()

    def _fail(self, exc: Exception) -> None:
        if self.state is State.CLOSED:
            return
        was_ready = self.state >= State.READY
        self.state = State.CLOSED
        if self.warmup_timer is not None:
            self.warmup_timer.cancel()
            self.warmup_timer = None
        if self.liveness_timer is not None:
            self.liveness_timer.cancel()
            self.liveness_timer = None
        streams, self.streams = self.streams, {}
        self.active = 0
        for stream_id, sink in streams.items():
            unprocessed = self.goaway_received and stream_id > self.last_stream_id
            if unprocessed and self.pool.retry(sink):
                continue
            sink.on_error(exc)
        if self.transport is not None:
            self.transport.abort()
        self.pool.on_closed(self, was_ready and not self.dead)


class _Warmup:
    """The warm-up request's sink: any complete answer proves the connection works end to end."""

    __slots__ = ("conn", "link", "stream_id", "t_sent", "request", "status")

    def __init__(self, conn: H2Connection) -> None:
        self.conn = conn
        self.link: Any = None
        self.stream_id = 0
        self.t_sent = 0
        self.status = 0

    def on_response(self, status: int, headers: list, end_stream: bool) -> None:
        self.status = status
        if end_stream:
            self.conn.warmed()

    def on_data(self, data: bytes, end_stream: bool) -> None:
        if end_stream:
            self.conn.warmed()

    def consumed(self, n: int) -> None:
        self.conn.codec.acknowledge(self.stream_id, n)

    def on_error(self, exc: BaseException) -> None:
        log.warning("upstream connection %d: warm-up failed: %s", self.conn.index, exc)
