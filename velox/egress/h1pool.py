"""The HTTP/1.1 pool of one upstream: keep-alive connections that grow with demand.

Used when the spec asks for `http1`, when an `http` origin is not told to use h2c, and when
ALPN shows the upstream has no h2 (the `Upstream` switches once). It keeps `spec.connections`
warm connections, opens one more per waiting attempt up to `MAX_H1_CONNECTIONS`, and closes
those above the pool size after `_H1_IDLE_S` unused. HTTP/1.1 cannot cancel one request: a
cancelled attempt closes its connection.

A warm connection that cannot be opened, or that closes before answering its warm-up, is
opened again after an exponential backoff (50 ms doubling to 5 s, jittered, as the HTTP/2
pool's), reset once a connection answers; the pool logs the upstream going down and coming
back, once each (BasePool.went_down, came_up).

Pipelining (`http1_pipeline` above 1, opt-in per upstream: a server that mishandles it would
mix answers up, and none says whether it supports it): the requests of one micro-batch share a
connection, up to that many on one, written with one write at the batch's flush; a connection
takes a new batch only once idle, so a slow answer holds at most the requests that came with
it. Streamed requests are sent alone, as without it: a stream holds its connection for the
whole generation, and whatever waited behind it would get its first token only after that (the
latency a client of a stream notices most). So are HEAD requests and bodies larger than a
write slice.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from velox.core.errors import UpstreamTimeout, UpstreamUnavailable
from velox.egress.h1conn import H1Base, H1Connection, PyH1Connection
from velox.egress.h2conn import WRITE_SLICE
from velox.egress.interfaces import UpstreamCall
from velox.egress.pool import BasePool, EgressOptions, next_backoff

if TYPE_CHECKING:
    from velox.egress.interfaces import CallHandle, Front, Headers

log = logging.getLogger("velox.egress")

MAX_H1_CONNECTIONS = 512
# HTTP/1.1 connections above the pool size are closed after this long unused.
_H1_IDLE_S = 30.0


class H1Pool(BasePool):
    protocol = "http1"

    def __init__(self, front: Front, options: EgressOptions) -> None:
        super().__init__(front, options)
        self.conns: set[H1Base] = set()  # open, idle or busy
        self.idle_conns: list[H1Base] = []  # most recently used last
        self.total = 0  # open or opening
        self.connecting = 0
        self.backoff = 0.0  # seconds before the next warm connection is opened again
        self.conn_class: type[H1Base] = H1Connection if options.native_h1 else PyH1Connection
        self.depth = self.spec.http1_pipeline  # requests at once on one connection
        self.dirty: list[H1Base] = []  # connections with requests queued for the flush

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        for _ in range(self.size):
            self._spawn(warm=True)
        self._schedule_sweep()

    @property
    def ready(self) -> bool:
        return self.ready_once

    @property
    def open_connections(self) -> int:
        return self.total

    def describe(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "authority": self.authority, "ready": self.ready,
                "connections": [], "open_connections": self.total,
                "idle_http1_connections": len(self.idle_conns), "queued": len(self.waiting),
                "in_flight": sum(len(c.live()) for c in self.conns)}

    def close(self) -> None:
        self._stop(UpstreamUnavailable("the gateway is shutting down"))
        for conn in list(self.conns):
            conn.close()

    # --- sending -------------------------------------------------------------------------------

    def dispatch(self, attempt: UpstreamCall) -> None:
        if self.sweep_idle:
            self.wake_sweep()
        if self.depth > 1 and self._pipeline(attempt):
            return
        if self.idle_conns:
            self.idle_conns.pop().send(attempt)
            return
        self._enqueue(attempt)
        # One new connection per waiting request at most: a busy connection coming free
        # first takes a waiter, and its would-be replacement would only sit idle.
        if (self.connecting < len(self.waiting) and self.total < MAX_H1_CONNECTIONS
                and not self.closing):
            self._spawn(warm=False)

    def _pipeline(self, attempt: UpstreamCall) -> bool:
        """Queue the attempt on the connection this batch fills, or on an idle one; False
        when it is to go alone (a stream, HEAD, a large body) or no connection has room."""
        client = attempt.client
        request = getattr(client, "request", None)  # the relay's exchange has it
        if client.method == b"HEAD" or (client.body and len(client.body) > WRITE_SLICE) or \
                (request is not None and request.stream):
            return False
        dirty = self.dirty
        if dirty:
            conn = dirty[-1]
            if not conn.closed and len(conn.behind) + 1 < self.depth:
                conn.queue(attempt)
                self.tally.pipelined += 1
                return True
        if self.idle_conns:
            conn = self.idle_conns.pop()
            conn.queue(attempt)
            dirty.append(conn)
            return True
        return False

    def flush(self) -> None:
        """Without pipelining each request was written as it was sent; with it, each
        connection the batch filled writes its requests at once."""
        dirty = self.dirty
        if dirty:
            self.dirty = []
            for conn in dirty:
                conn.flush_out()

    def _live(self) -> Iterator[UpstreamCall]:
        for conn in self.conns:
            if conn.attempt is not None:
                yield conn.attempt
            yield from conn.behind

    # --- connection events ---------------------------------------------------------------------

    def on_idle(self, conn: H1Base, answered: bool = True) -> None:
        """`conn` can take a request: after a response (answered), or freshly opened."""
        conn.warm = True
        if answered:
            self.backoff = 0.0
            self.came_up()
        attempt = self._next_waiting()
        if attempt is not None:
            conn.send(attempt)
            return
        if self.closing:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self.idle_conns.append(conn)
        if not self.ready_once and len(self.idle_conns) >= self.size:
            self.ready_once = True
            log.info("upstream pool warm: %d HTTP/1.1 connection(s) to %s",
                     self.size, self.authority)

    def on_closed(self, conn: H1Base) -> None:
        self.total -= 1
        self.conns.discard(conn)
        try:
            self.idle_conns.remove(conn)
        except ValueError:
            pass
        if self.closing or self.total >= self.size:
            return
        if conn.warm:
            self._spawn(warm=True)  # a working connection ended (keep-alive over, cancelled)
        else:  # it never answered: the upstream takes connections but does not serve
            self._reopen()

    # --- connecting ----------------------------------------------------------------------------

    def _spawn(self, warm: bool) -> None:
        # Counted before the connect starts, so one batch cannot overshoot the cap.
        self.total += 1
        self.connecting += 1
        self._run(self._open(warm))

    async def _open(self, warm: bool) -> None:
        spec = self.spec
        try:
            ctx = self.front.tls(("http/1.1",)) if spec.scheme == "https" else None
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: self.conn_class(self), spec.host, spec.port,
                    ssl=ctx, server_hostname=spec.host if ctx else None),
                self.connect_timeout_s,
            )
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            self.connecting -= 1
            self.total -= 1
            self.tally.connect_failures += 1
            self.went_down(f"upstream connect to {self.authority} failed: "
                           f"{self.connect_error(exc)}")
            if self.total == 0:
                self._fail_waiting(UpstreamUnavailable(
                    f"the upstream {self.authority} is unreachable"))
            if warm and not self.closing:
                self._reopen()
            return
        self.connecting -= 1
        if self.closing:
            conn.close()
            return
        if conn.closed:
            return  # the upstream closed it straight away; on_closed has replaced it
        self.conns.add(conn)
        if warm and not conn.warm:
            conn.send(self.warmup_attempt(_Warmup(self, conn)))
        else:
            self.on_idle(conn, answered=False)

    def _reopen(self) -> None:
        """Open a warm connection in place of one that failed, after the backoff (which the
        failure doubles). It is not counted in `total` while it waits, so requests queued
        meanwhile are still failed at once when nothing else is open ("unreachable")."""
        self.backoff = next_backoff(self.backoff)
        self._run(self._open_later(self.backoff * random.uniform(0.5, 1.0)))

    async def _open_later(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if not self.closing:
            self._spawn(warm=True)

    def sweep(self, now: float) -> None:
        super().sweep(now)
        # Close connections beyond the pool size that a burst opened and that have sat unused
        # for a while (the least recently used are at the front of the idle list).
        idle = self.idle_conns
        while len(idle) > self.size and now - idle[0].idle_since > _H1_IDLE_S:
            idle.pop(0).close()


class _Warmup:
    """The warm-up request of a new HTTP/1.1 connection (a `Client`)."""

    __slots__ = ("pool", "conn", "attempt", "method", "path", "headers_out", "body")

    def __init__(self, pool: H1Pool, conn: H1Base) -> None:
        self.pool = pool
        self.conn = conn
        self.attempt: CallHandle | None = None
        self.method = b"GET"
        self.path = pool.warmup_path
        self.headers_out: Headers = pool.warmup_headers
        self.body = b""

    @property
    def paused(self) -> bool:
        return False

    def on_response(self, status: int, headers: Headers, end_stream: bool) -> None:
        pass

    def on_data(self, data: bytes, end_stream: bool) -> None:
        pass

    def on_answer(self, status: int, headers: Headers, body: bytes) -> None:
        pass

    def on_error(self, exc: BaseException) -> None:
        if isinstance(exc, UpstreamTimeout):  # no answer within the connect timeout
            self.pool.warmup_expired(f"upstream {self.pool.authority}")
            self.conn.close()  # on_closed opens the replacement, after the backoff
        else:  # the connection closed or broke: on_closed opens the replacement
            self.pool.went_down(f"upstream {self.pool.authority}: warm-up failed: {exc}")
