"""The per-worker upstream pool: pre-warmed connections, round-robin, queueing, retries.

HTTP/2 mode keeps `VELOX_EGRESS_POOL_CONNECTIONS` multiplexed connections and spreads requests
over them round-robin, respecting each server's MAX_CONCURRENT_STREAMS (capped at 512) and
queueing beyond it. HTTP/1.1 mode (no h2 offered by ALPN, or VELOX_UPSTREAM_PROTOCOL=http1)
keeps a keep-alive pool that grows on demand up to `MAX_H1_CONNECTIONS`.

Every connection is warmed with a GET of VELOX_UPSTREAM_WARMUP_PATH before it takes traffic; a
connection that is lost or told GOAWAY is replaced with exponential backoff, and requests the
upstream has provably not processed (queued here, above a GOAWAY's last stream id, or refused
with REFUSED_STREAM) are retried on another connection. Requests that may have been processed
are failed with 502, never replayed. Deadlines: response headers within
VELOX_REQUEST_TIMEOUT_MS (504), and once streaming, no gap over VELOX_STREAM_IDLE_TIMEOUT_MS.

Liveness: the warm-up must be answered within VELOX_CONNECT_TIMEOUT_MS, else the connection is
closed and reopened with backoff; HTTP/2 connections are probed with PING (h2conn._liveness) and
replaced when one goes unanswered for VELOX_UPSTREAM_PING_TIMEOUT_MS; a connection on which
`TIMEOUTS_TO_RETIRE` requests in a row time out is retired (request_timed_out).

Imports: egress.codec, egress.h2conn, egress.h1conn, errors, config, stdlib.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from collections import deque
from typing import Any

from velox.config import Settings
from velox.egress.codec import make_codec
from velox.egress.h1conn import H1Connection
from velox.egress.h2conn import BACKLOG_LIMIT, H2Connection, State
from velox.errors import Overloaded, UpstreamTimeout, UpstreamUnavailable

log = logging.getLogger("velox.egress")

MAX_STREAMS = 512
MAX_H1_CONNECTIONS = 512
# A request the upstream provably did not process may be re-sent; this bounds the loop if
# the upstream keeps refusing.
MAX_ATTEMPTS = 5
_BACKOFF_MIN_S = 0.05
# HTTP/1.1 connections above the pool size are closed after this long unused.
_H1_IDLE_S = 30.0
_BACKOFF_MAX_S = 5.0


def make_ssl_context(settings: Settings, alpn: list[str]) -> ssl.SSLContext:
    """Verifying client context; VELOX_UPSTREAM_CA_FILE and SSL_CERT_FILE add trusted CAs."""
    ctx = ssl.create_default_context()
    for extra in (settings.upstream_ca_file, settings.ssl_cert_file):
        if extra:
            ctx.load_verify_locations(cafile=extra)
    ctx.set_alpn_protocols(alpn)
    return ctx


class Pool:
    def __init__(self, settings: Settings, loop: asyncio.AbstractEventLoop) -> None:
        self.settings = settings
        self.loop = loop
        self.host = settings.upstream_host
        self.port = settings.upstream_port
        self.authority = settings.upstream_authority
        self.scheme = settings.upstream_scheme
        self.size = settings.egress_pool_connections
        self.protocol = settings.egress_protocol
        self.codec_name = settings.egress if settings.egress in ("framer", "jh2", "h2") else "framer"
        self.warmup_path = settings.upstream_warmup_path.encode()
        key = settings.upstream_api_key
        self.warmup_headers = [(b"authorization", b"Bearer " + key.encode())] if key else []
        self.connect_timeout_s = settings.connect_timeout_ms / 1000
        self.request_timeout_s = settings.request_timeout_ms / 1000
        self.idle_timeout_s = settings.stream_idle_timeout_ms / 1000
        self.ping_interval_s = settings.upstream_ping_interval_ms / 1000  # 0: no liveness PINGs
        self.ping_timeout_s = settings.upstream_ping_timeout_ms / 1000
        # How often each connection checks its liveness; a connection with open streams and no
        # frames for a whole tick gets a PING.
        self.liveness_tick_s = min(1.0, self.ping_interval_s or 1.0, self.ping_timeout_s / 2)

        self.conns: list[H2Connection | None] = [None] * self.size
        self.waiting: deque[Any] = deque()
        self.waiting_limit = settings.ring_depth
        self.dirty: list[H2Connection] = []
        self.flush_scheduled = False
        self.rr = 0
        self.backoff = [0.0] * self.size
        self.connecting = [False] * self.size
        self.closing = False
        self.ready_once = False
        # Exchanges in flight, oldest first; each leaves as soon as it is done (done()), so a
        # request's objects die young, where the garbage collector's work is cheap.
        self.inflight: dict[Any, None] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.tls_contexts: dict[tuple[str, ...], ssl.SSLContext] = {}
        self.timer: asyncio.TimerHandle | None = None
        # HTTP/1.1 mode
        self.h1_idle_conns: list[H1Connection] = []  # most recently used last
        self.h1_total = 0
        self.h1_connecting = 0
        # counters the worker copies into shared memory
        self.goaways = 0
        self.reconnects = 0
        self.retries = 0
        self.streams_cancelled = 0
        self.connect_failures = 0
        self.warmup_timeouts = 0
        self.ping_timeouts = 0
        self.timeout_retirements = 0

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        for index in range(self.size):
            self._spawn(index)
        self._schedule_sweep()

    @property
    def ready(self) -> bool:
        if self.protocol == "http1":
            return self.ready_once
        return self.ready_once and any(c is not None and c.state is State.READY
                                       for c in self.conns)

    @property
    def open_connections(self) -> int:
        if self.protocol == "http1":
            return self.h1_total
        return sum(1 for c in self.conns if c is not None and c.state < State.CLOSED)

    def describe(self) -> dict[str, Any]:
        """The pool's state for the admin's /stats: per connection, and its counters."""
        now = time.monotonic()
        conns = []
        if self.protocol != "http1":  # HTTP/1.1 connections are anonymous: counted below
            conns = [{"index": i, "state": c.state.name if c is not None else
                      "CONNECTING" if self.connecting[i] else "DOWN",
                      "active_streams": 0 if c is None else c.active,
                      "max_concurrent_streams": 0 if c is None else c.codec.max_concurrent_streams,
                      "age_s": round(now - c.opened_at, 1) if c is not None and c.opened_at
                      else None}
                     for i, c in enumerate(self.conns)]
        return {
            "protocol": self.protocol, "authority": self.authority, "ready": self.ready,
            "connections": conns, "open_connections": self.open_connections,
            "idle_http1_connections": len(self.h1_idle_conns),
            "queued": len(self.waiting), "in_flight": len(self.inflight),
            "goaways": self.goaways, "reconnects": self.reconnects, "retries": self.retries,
            "streams_cancelled": self.streams_cancelled,
            "connect_failures": self.connect_failures,
            "warmup_timeouts": self.warmup_timeouts,
            "ping_timeouts": self.ping_timeouts,
            "timeout_retirements": self.timeout_retirements,
        }

    async def close(self) -> None:
        self.closing = True
        if self.timer is not None:
            self.timer.cancel()
        for task in list(self.tasks):
            task.cancel()
        for conn in self.conns:
            if conn is not None:
                conn.close()
        for h1 in list(self.h1_idle_conns):
            h1.close()
        while self.waiting:
            self.waiting.popleft().on_error(UpstreamUnavailable("the gateway is shutting down"))
        await asyncio.sleep(0)

    # --- submitting --------------------------------------------------------------------------

    def submit(self, exchange: Any) -> None:
        """Send now if a connection has room, else queue; the worker flushes after the batch."""
        exchange.deadline = time.monotonic() + self.request_timeout_s
        self.inflight[exchange] = None
        self._dispatch(exchange)

    def done(self, exchange: Any) -> None:
        """The exchange is over (answered, failed or abandoned): stop watching its deadlines."""
        self.inflight.pop(exchange, None)

    def _dispatch(self, exchange: Any) -> None:
        if self.protocol == "http1":
            self._dispatch_h1(exchange)
            return
        conn = self._pick()
        if conn is None:
            self._enqueue(exchange)
        else:
            conn.send(exchange)
            self.mark_dirty(conn)

    def _pick(self) -> H2Connection | None:
        """Round-robin over connections with free streams, passing over any that is busy
        writing a large upload unless no other can take the request."""
        conns = self.conns
        n = len(conns)
        start = self.rr
        fallback = None
        for i in range(n):
            conn = conns[(start + i) % n]
            if conn is not None and conn.capacity > 0:
                if conn.backlog_bytes > BACKLOG_LIMIT:
                    fallback = fallback or conn
                    continue
                self.rr = (start + i + 1) % n
                return conn
        return fallback

    def _enqueue(self, exchange: Any) -> None:
        if len(self.waiting) >= self.waiting_limit:
            exchange.on_error(Overloaded(retry_after_s=1))
            return
        exchange.link = self
        self.waiting.append(exchange)

    def retry(self, sink: Any) -> bool:
        """Re-send a request the upstream has not processed; False if it must fail instead."""
        if self.closing or getattr(sink, "finished", True) or sink.attempts + 1 >= MAX_ATTEMPTS:
            return False
        sink.attempts += 1
        self.retries += 1
        self._dispatch(sink)
        return True

    def flush(self) -> None:
        """Write each connection's pending frames with one write (called after every batch)."""
        self.flush_scheduled = False
        dirty = self.dirty
        if dirty:
            self.dirty = []
            for conn in dirty:
                conn.flush()

    def mark_dirty(self, conn: H2Connection) -> None:
        if not conn.flush_pending:
            conn.flush_pending = True
            self.dirty.append(conn)
            if not self.flush_scheduled:
                self.flush_scheduled = True
                self.loop.call_soon(self.flush)

    # --- link interface for queued exchanges ---------------------------------------------------

    def cancel(self, exchange: Any) -> None:
        try:
            self.waiting.remove(exchange)
        except ValueError:
            pass

    def acknowledge(self, exchange: Any, n: int) -> None:
        pass

    def pause_for(self, exchange: Any) -> None:
        pass

    # --- connection events ---------------------------------------------------------------------

    def on_connected(self, conn: H2Connection) -> None:
        # Registered from connection_made, so the warm-up answer can never beat it here.
        self.conns[conn.index] = conn

    def on_ready(self, conn: H2Connection) -> None:
        self.backoff[conn.index] = 0.0
        if not self.ready_once and all(c is not None and c.state >= State.READY
                                       for c in self.conns):
            self.ready_once = True
            log.info("upstream pool warm: %d HTTP/2 connection(s) to %s",
                     self.size, self.authority)
        self.on_capacity(conn)

    def on_capacity(self, conn: H2Connection) -> None:
        waiting = self.waiting
        while waiting and conn.capacity > 0:
            exchange = waiting.popleft()
            if not exchange.finished:
                conn.send(exchange)
                self.mark_dirty(conn)

    def on_draining(self, conn: H2Connection) -> None:
        if self.conns[conn.index] is conn:
            self.conns[conn.index] = None
            self.reconnects += 1
            self._spawn(conn.index)

    def on_closed(self, conn: H2Connection, was_ready: bool) -> None:
        if self.conns[conn.index] is not conn:
            return  # a retired connection finishing; its replacement is already underway
        self.conns[conn.index] = None
        if self.closing:
            return
        self.reconnects += 1
        self._bump_backoff(conn.index, healthy=was_ready)
        self._spawn(conn.index)

    def on_no_h2(self, conn: H2Connection) -> None:
        """ALPN picked HTTP/1.1: the upstream has no h2, so this pool becomes an HTTP/1.1 pool."""
        if self.settings.upstream_protocol == "h2":
            return  # the connect path reports it as a failure and backs off
        if self.protocol != "http1":
            log.warning("%s does not offer HTTP/2; falling back to HTTP/1.1 keep-alive",
                        self.authority)
            self.protocol = "http1"
            self.conns = [None] * self.size
            for _ in range(self.size):
                self._spawn_h1(warm=True)
            waiting, self.waiting = self.waiting, deque()
            for exchange in waiting:
                self._dispatch_h1(exchange)

    # --- connecting ----------------------------------------------------------------------------

    def _spawn(self, index: int) -> None:
        if self.closing:
            return
        if self.protocol == "http1":
            self._spawn_h1(warm=True)
            return
        else:
            if self.connecting[index]:
                return
            self.connecting[index] = True
            task = self.loop.create_task(self._open_h2(index))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _spawn_h1(self, warm: bool) -> None:
        # Counted before the connect starts, so one batch cannot overshoot the cap.
        self.h1_total += 1
        self.h1_connecting += 1
        task = self.loop.create_task(self._open_h1(warm))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _bump_backoff(self, index: int, healthy: bool) -> None:
        if healthy:
            self.backoff[index] = 0.0
        else:
            prev = self.backoff[index]
            self.backoff[index] = min(_BACKOFF_MAX_S, max(_BACKOFF_MIN_S, prev * 2))

    async def _open_h2(self, index: int) -> None:
        try:
            delay = self.backoff[index]
            if delay:
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            codec = make_codec(self.codec_name, self.authority.encode(), self.scheme.encode())
            ctx = self._tls(tuple(self._alpn())) if self.scheme == "https" else None
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: H2Connection(self, index, codec), self.host, self.port,
                    ssl=ctx, server_hostname=self.host if ctx else None),
                self.connect_timeout_s,
            )
            if conn.state is State.CLOSED and self.settings.upstream_protocol == "h2":
                raise OSError(f"{self.authority} did not negotiate h2 via ALPN")
            if self.closing or self.protocol != "h2":
                conn.close()
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
            self.connect_failures += 1
            log.warning("upstream connect to %s failed: %s", self.authority,
                        self._connect_error(exc))
            self._bump_backoff(index, healthy=False)
            self._fail_waiting_if_unreachable()
            self.loop.call_soon(self._spawn, index)
        finally:
            self.connecting[index] = False

    def _connect_error(self, exc: BaseException) -> str:
        """What went wrong, never an empty string: a timeout's str() is "" (finding 15)."""
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
            return (f"no connection to {self.host}:{self.port} within "
                    f"{self.settings.connect_timeout_ms} ms (VELOX_CONNECT_TIMEOUT_MS)")
        return str(exc) or type(exc).__name__

    def _tls(self, alpn: tuple[str, ...]) -> ssl.SSLContext:
        """One context per ALPN list, built once: loading the CA bundle costs milliseconds,
        which an HTTP/1.1 pool opening connections under load would pay on the loop each time."""
        ctx = self.tls_contexts.get(alpn)
        if ctx is None:
            ctx = self.tls_contexts[alpn] = make_ssl_context(self.settings, list(alpn))
        return ctx

    def _alpn(self) -> list[str]:
        if self.settings.upstream_protocol == "h2":
            return ["h2"]
        return ["h2", "http/1.1"] if self.protocol == "h2" else ["http/1.1"]

    def _fail_waiting_if_unreachable(self) -> None:
        # Nothing can carry the queued requests: fail them now rather than at their deadline.
        if self.protocol == "h2" and not any(c is not None and c.state <= State.READY
                                              for c in self.conns):
            while self.waiting:
                self.waiting.popleft().on_error(
                    UpstreamUnavailable(f"the upstream {self.authority} is unreachable"))

    # --- HTTP/1.1 mode -------------------------------------------------------------------------

    def _dispatch_h1(self, exchange: Any) -> None:
        if self.h1_idle_conns:
            conn = self.h1_idle_conns.pop()
            request = exchange.request
            conn.send(exchange, request.method, exchange.path, exchange.headers_out, request.body)
        else:
            self._enqueue(exchange)
            # One new connection per waiting request at most: a busy connection coming free
            # first takes a waiter, and its would-be replacement would only sit idle.
            if (self.h1_connecting < len(self.waiting) and self.h1_total < MAX_H1_CONNECTIONS
                    and not self.closing):
                self._spawn_h1(warm=False)

    async def _open_h1(self, warm: bool) -> None:
        try:
            ctx = self._tls(("http/1.1",)) if self.scheme == "https" else None
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: H1Connection(self), self.host, self.port,
                    ssl=ctx, server_hostname=self.host if ctx else None),
                self.connect_timeout_s,
            )
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
            self.h1_connecting -= 1
            self.h1_total -= 1
            self.connect_failures += 1
            log.warning("upstream connect to %s failed: %s", self.authority,
                        self._connect_error(exc))
            if self.h1_total == 0:
                while self.waiting:
                    self.waiting.popleft().on_error(
                        UpstreamUnavailable(f"the upstream {self.authority} is unreachable"))
            if warm and not self.closing:
                await asyncio.sleep(_BACKOFF_MIN_S * random.uniform(1, 4))
                self._spawn_h1(warm=True)
            return
        self.h1_connecting -= 1
        if self.closing:
            conn.close()
            return
        if conn.closed:
            return  # the upstream closed it straight away; h1_closed has replaced it
        if warm and not conn.warm:
            warmup = _H1Warmup(self, conn)
            conn.send(warmup, b"GET", self.warmup_path, self.warmup_headers, None)
            # The warm-up gets the connect timeout too: an upstream that accepts the connection
            # but never answers would otherwise hold this pool slot, unlogged, forever.
            self.loop.call_later(self.connect_timeout_s, self._h1_warmup_expired, warmup)
        else:
            self.h1_idle(conn)

    def h1_idle(self, conn: H1Connection) -> None:
        conn.warm = True
        while self.waiting:
            exchange = self.waiting.popleft()
            if not exchange.finished:
                request = exchange.request
                conn.send(exchange, request.method, exchange.path, exchange.headers_out,
                          request.body)
                return
        if self.closing:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self.h1_idle_conns.append(conn)
        if not self.ready_once and len(self.h1_idle_conns) >= self.size:
            self.ready_once = True
            log.info("upstream pool warm: %d HTTP/1.1 connection(s) to %s",
                     self.size, self.authority)

    def _h1_warmup_expired(self, warmup: _H1Warmup) -> None:
        conn = warmup.conn
        if warmup.finished or conn.closed or conn.sink is not warmup:
            return
        log.warning("upstream %s did not answer the warm-up request GET %s within %d ms "
                    "(VELOX_CONNECT_TIMEOUT_MS); reconnecting", self.authority,
                    self.warmup_path.decode(), self.settings.connect_timeout_ms)
        self.warmup_timeouts += 1
        conn.sink = None  # closed by us: no "warm-up failed" line on top of this one
        conn.close()

    def h1_closed(self, conn: H1Connection) -> None:
        self.h1_total -= 1
        try:
            self.h1_idle_conns.remove(conn)
        except ValueError:
            pass
        if not self.closing and self.h1_total < self.size:
            self._spawn_h1(warm=True)

    # --- deadlines -----------------------------------------------------------------------------

    def _schedule_sweep(self) -> None:
        shortest = min(self.request_timeout_s, self.idle_timeout_s)
        tick = min(1.0, max(0.01, shortest / 4))
        self.timer = self.loop.call_later(tick, self._sweep)

    def _sweep(self) -> None:
        now = time.monotonic()
        idle_limit = now - self.idle_timeout_s
        expired = []
        for exchange in self.inflight:
            if exchange.finished:
                continue
            if not exchange.t_headers:
                if exchange.deadline <= now:
                    expired.append((exchange, "response headers"))
            elif exchange.last_activity < idle_limit:
                expired.append((exchange, "the next chunk of the response"))
        for exchange, waiting_for in expired:
            self._expire(exchange, waiting_for)
        self._reap_idle_h1(now)
        if not self.closing:
            self._schedule_sweep()

    def _reap_idle_h1(self, now: float) -> None:
        """Close HTTP/1.1 connections beyond the pool size that a burst opened and that have
        sat unused for a while (the least recently used are at the front of the idle list)."""
        idle = self.h1_idle_conns
        while len(idle) > self.size and now - idle[0].idle_since > _H1_IDLE_S:
            idle.pop(0).close()

    def _expire(self, exchange: Any, waiting_for: str) -> None:
        link = exchange.link
        exchange.on_error(UpstreamTimeout(f"The upstream did not send {waiting_for} in time."))
        if link is not None:
            link.cancel(exchange)
            if not exchange.t_headers and isinstance(link, H2Connection):
                link.request_timed_out()


class _H1Warmup:
    __slots__ = ("pool", "conn", "link", "stream_id", "t_sent", "attempts", "finished")

    def __init__(self, pool: Pool, conn: H1Connection) -> None:
        self.pool = pool
        self.conn = conn
        self.link: Any = None
        self.stream_id = 0
        self.t_sent = 0
        self.attempts = MAX_ATTEMPTS
        self.finished = False

    def on_response(self, status: int, headers: list, end_stream: bool) -> None:
        pass

    def on_data(self, data: bytes, end_stream: bool) -> None:
        self.finished = end_stream

    def consumed(self, n: int) -> None:
        pass

    def on_error(self, exc: BaseException) -> None:
        log.warning("upstream warm-up failed: %s", exc)
