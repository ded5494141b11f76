"""The HTTP/2 pool of one upstream: pre-warmed multiplexed connections, least-busy, queueing.

It keeps `spec.connections` connections and gives each attempt to the one with the fewest open
streams (ties to the last one used: `_pick`), respecting each server's MAX_CONCURRENT_STREAMS
(capped at 512) and queueing beyond it. Every connection is warmed
with a GET of the spec's warm-up path before it takes traffic; a connection that is lost or told
GOAWAY is replaced with exponential backoff. Requests the upstream has provably not processed (above
a GOAWAY's last stream id, refused with REFUSED_STREAM, or refused by the codec) go back to the
`Upstream` (`front.retry`), which sends them again on this upstream; requests that may have been
processed are failed here (UpstreamUnavailable when the connection is lost), and
velox.routing.dispatch decides whether to send them to another target before anything reached the
client.

Liveness: the warm-up must be answered within the connect timeout (its attempt's deadline),
else the connection is closed and reopened with backoff; each sweep tick, a connection with
streams open and no frame for a tick, or idle for VELOX_UPSTREAM_PING_INTERVAL_MS, is sent a
PING (`H2Connection.check_liveness`) and replaced when it goes unanswered for
VELOX_UPSTREAM_PING_TIMEOUT_MS; a connection on which `TIMEOUTS_TO_RETIRE` requests in a row
get no response headers in time is retired (`request_timed_out`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from velox.core.errors import UpstreamUnavailable
from velox.egress.h2conn import BACKLOG_LIMIT, H2Connection, State
from velox.egress.interfaces import UpstreamCall
from velox.egress.pool import BasePool, EgressOptions, next_backoff

if TYPE_CHECKING:
    from velox.egress.interfaces import Carrier, Front

log = logging.getLogger("velox.egress")
_READY = State.READY


class H2Pool(BasePool):
    protocol = "h2"

    def __init__(self, front: Front, options: EgressOptions) -> None:
        super().__init__(front, options)
        self.conns: list[H2Connection | None] = [None] * self.size
        # Retired connections (GOAWAY, timeouts, stream ids) still finishing their streams: no
        # longer in `conns`, but their streams keep their deadlines (swept) until they close.
        self.retired: set[H2Connection] = set()
        self.dirty: list[H2Connection] = []
        self.flush_scheduled = False
        self.last_pick = 0  # the index of the connection picked last (_pick)
        self.backoff = [0.0] * self.size
        self.connecting = [False] * self.size

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        for index in range(self.size):
            self._spawn(index)
        self._schedule_sweep()

    @property
    def ready(self) -> bool:
        return self.ready_once and any(c is not None and c.state is State.READY
                                       for c in self.conns)

    @property
    def open_connections(self) -> int:
        return sum(1 for c in self.conns if c is not None and c.state < State.CLOSED)

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        conns = [{"index": i, "state": c.state.name if c is not None else
                  "CONNECTING" if self.connecting[i] else "DOWN",
                  "active_streams": 0 if c is None else c.active,
                  "max_concurrent_streams": 0 if c is None else c.codec.max_concurrent_streams,
                  "age_s": round(now - c.opened_at, 1) if c is not None and c.opened_at
                  else None}
                 for i, c in enumerate(self.conns)]
        return {"protocol": self.protocol, "authority": self.authority, "ready": self.ready,
                "connections": conns, "open_connections": self.open_connections,
                "idle_http1_connections": 0, "queued": len(self.waiting),
                "in_flight": sum(c.active for c in self.conns if c is not None)}

    def close(self) -> None:
        self._stop(UpstreamUnavailable("the gateway is shutting down"))
        for conn in self.conns:
            if conn is not None:
                conn.close()
        for conn in list(self.retired):
            conn.close()

    # --- sending -------------------------------------------------------------------------------

    def dispatch(self, attempt: UpstreamCall) -> None:
        """Encode the attempt on a connection with room (else queue it); its frames go out
        with the caller's `flush`, which every submitter calls after its submits (the
        worker after each micro-batch). Scheduling a flush here as well cost a loop callback
        per request (~0.7 us on uvloop) that found nothing left to write."""
        if self.sweep_idle:
            self.wake_sweep()
        conn = self._pick()
        if conn is None:
            self._enqueue(attempt)
        else:
            conn.send(attempt)
            if not conn.flush_pending:
                conn.flush_pending = True
                self.dirty.append(conn)

    def _pick(self) -> H2Connection | None:
        """The connection with the fewest open streams, ties going to the one picked last,
        passing over any that is busy writing a large upload unless no other can take the
        request. Under load that spreads a micro-batch over the connections as round-robin
        did; with one request at a time it keeps every request on one connection, whose TLS
        state, codec and buffers stay in cache (at one client connection, four end-to-end A/B
        runs on a busy 2-core host: 0 to 6% less CPU per request, median 3%; none at 64)."""
        conns = self.conns
        n = len(conns)
        i = self.last_pick  # the last pick, looked at first
        best = fallback = None
        fewest = 1 << 31
        for _ in range(n):
            conn = conns[i]
            # conn.capacity > 0, inlined: this runs once per request
            if conn is not None and conn.state is _READY and \
                    conn.codec.max_concurrent_streams > conn.active:
                if conn.backlog_bytes > BACKLOG_LIMIT:
                    fallback = fallback or conn
                elif conn.active < fewest:
                    best, fewest, self.last_pick = conn, conn.active, i
                    if not fewest:
                        break  # an idle connection: none can have fewer
            i = i + 1 if i + 1 < n else 0
        return best or fallback

    def flush(self) -> None:
        """Write each connection's pending frames with one write (called after every batch)."""
        self.flush_scheduled = False
        dirty = self.dirty
        if dirty:
            self.dirty = []
            for conn in dirty:
                conn.flush()

    def mark_dirty(self, conn: H2Connection) -> None:
        """Flush conn at the end of this loop pass: for frames made by connection events
        (window updates, resets, PINGs, queued attempts given capacity), which no batch's
        flush follows."""
        if not conn.flush_pending:
            conn.flush_pending = True
            self.dirty.append(conn)
            if not self.flush_scheduled:
                self.flush_scheduled = True
                self.loop.call_soon(self.flush)

    def sweep(self, now: float) -> None:
        super().sweep(now)
        options = self.options
        if options.liveness_tick_s:  # retired connections too: their streams still wait
            for conn in (*self.conns, *self.retired):
                if conn is not None:
                    conn.check_liveness(now, options.liveness_tick_s, options.ping_interval_s,
                                        options.ping_timeout_s)

    def _idle_for(self, now: float) -> float:
        """No attempt: the sweep comes back when the first idle connection's PING is due
        (VELOX_UPSTREAM_PING_INTERVAL_MS after it went quiet), or at once while a PING waits
        for its ACK (VELOX_UPSTREAM_PING_TIMEOUT_MS is watched at the tick)."""
        rest = super()._idle_for(now)
        interval = self.options.ping_interval_s
        if not rest or not self.options.liveness_tick_s:
            return rest
        for conn in (*self.conns, *self.retired):
            if conn is not None and conn.state is _READY:
                if conn.ping_sent_at:
                    return 0.0
                rest = min(rest, conn.quiet_since + interval - now)
        return rest

    def _headers_timed_out(self, conn: Carrier) -> None:
        if isinstance(conn, H2Connection):
            conn.request_timed_out()

    def _live(self) -> Iterator[UpstreamCall]:
        for conn in self.conns:
            if conn is not None:
                yield from conn.streams.values()
        for conn in self.retired:
            yield from conn.streams.values()

    # --- connection events ---------------------------------------------------------------------

    def on_connected(self, conn: H2Connection) -> None:
        # Registered from connection_made, so the warm-up answer can never beat it here.
        self.conns[conn.index] = conn

    def on_ready(self, conn: H2Connection) -> None:
        self.backoff[conn.index] = 0.0
        self.came_up()
        if not self.ready_once and all(c is not None and c.state >= State.READY
                                       for c in self.conns):
            self.ready_once = True
            log.info("upstream pool warm: %d HTTP/2 connection(s) to %s",
                     self.size, self.authority)
        self.on_capacity(conn)

    def on_capacity(self, conn: H2Connection) -> None:
        while self.waiting and conn.capacity > 0:
            attempt = self._next_waiting()
            if attempt is not None:
                conn.send(attempt)
                self.mark_dirty(conn)

    def on_draining(self, conn: H2Connection) -> None:
        if self.conns[conn.index] is conn:
            self.conns[conn.index] = None
            self.retired.add(conn)
            self.tally.reconnect()
            self._spawn(conn.index)

    def on_closed(self, conn: H2Connection, was_ready: bool) -> None:
        self.retired.discard(conn)
        if self.conns[conn.index] is not conn:
            return  # a retired connection finishing; its replacement is already underway
        self.conns[conn.index] = None
        if self.closing:
            return
        self.tally.reconnect()
        self.backoff[conn.index] = 0.0 if was_ready else next_backoff(self.backoff[conn.index])
        self._spawn(conn.index)

    # --- connecting ----------------------------------------------------------------------------

    def _spawn(self, index: int) -> None:
        if self.closing or self.connecting[index]:
            return
        self.connecting[index] = True
        self._run(self._open(index))

    def _alpn(self) -> tuple[str, ...]:
        return ("h2",) if self.spec.protocol == "h2" else ("h2", "http/1.1")

    async def _open(self, index: int) -> None:
        spec = self.spec
        try:
            delay = self.backoff[index]
            if delay:
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            codec = self.options.codec(self.authority.encode(), spec.scheme.encode())
            ctx = self.front.tls(self._alpn()) if spec.scheme == "https" else None
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: H2Connection(self, index, codec), spec.host, spec.port,
                    ssl=ctx, server_hostname=spec.host if ctx else None),
                self.connect_timeout_s,
            )
            if conn.state is State.CLOSED and spec.protocol == "h2":
                raise OSError(f"{self.authority} did not negotiate h2 via ALPN")
            if self.closing:
                conn.close()
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            self.tally.connect_failures += 1
            self.went_down(f"upstream connect to {self.authority} failed: "
                           f"{self.connect_error(exc)}")
            self.backoff[index] = next_backoff(self.backoff[index])
            self._fail_waiting_if_unreachable()
            self.loop.call_soon(self._spawn, index)
        finally:
            self.connecting[index] = False

    def _fail_waiting_if_unreachable(self) -> None:
        # Nothing can carry the queued requests: fail them now rather than at their deadline.
        if not any(c is not None and c.state <= State.READY for c in self.conns):
            self._fail_waiting(UpstreamUnavailable(
                f"the upstream {self.authority} is unreachable"))
