"""What the HTTP/2 and the HTTP/1.1 pool share: the wait queue, the deadline sweep, TLS contexts.

A pool belongs to one `upstream.Upstream` and serves its `UpstreamSpec`. Attempts that find no
connection with room wait in `waiting` (bounded by VELOX_RING_DEPTH; beyond it 503 overloaded).
Deadlines: response headers by the attempt's `deadline` (VELOX_REQUEST_TIMEOUT_MS, or the
upstream's `request_timeout_ms`: 504), and once streaming no gap over
VELOX_STREAM_IDLE_TIMEOUT_MS. The sweep walks the attempts the pool's connections carry and the
queue a few times per shortest timeout; there is no per-request registry to keep up to date.

Reachability, for the operator: an upstream that cannot be connected to, or whose new
connections never answer their warm-up, is logged once when it goes down (`went_down`) and
once when a connection answers again (`came_up`), however many reconnects fail in between
(each at debug level); both pools reconnect with the same exponential backoff (`next_backoff`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from velox.config.settings import Settings
from velox.config.tables import DEFAULT_UPSTREAM
from velox.core.errors import Overloaded, UpstreamTimeout, VeloxError
from velox.egress.codec import Codec
from velox.egress.framer import Framer
from velox.egress.interfaces import MAX_ATTEMPTS, UpstreamCall
from velox.egress.nativecodec import NativeCodec

if TYPE_CHECKING:
    from velox.egress.interfaces import Carrier, Client, Front

log = logging.getLogger("velox.egress")

_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 5.0
# The sweep's period while a pool carries no attempt: nothing has a deadline then, and what
# is left (an idle HTTP/2 connection's PING, due after VELOX_UPSTREAM_PING_INTERVAL_MS: see
# H2Pool._idle_for; an HTTP/1.1 pool's surplus connections closed) can wait this long. The
# tick (up to 1 s) woke every idle worker once a second per upstream.
_IDLE_SWEEP_S = 5.0
# Builds the HTTP/2 codec of one connection from its :authority and :scheme.
CodecFactory = Callable[[bytes, bytes], Codec]


@dataclass(frozen=True, slots=True)
class EgressOptions:
    """Worker-wide egress settings; everything per upstream is in its UpstreamSpec."""

    # The native codec, or with VELOX_NATIVE=0 its Python twin, the framer (it was ported from).
    codec: CodecFactory = NativeCodec
    # HTTP/1.1 responses read by the native reader (h1conn.H1Connection), or with
    # VELOX_NATIVE=0 by its twin, httptools alone (h1conn.PyH1Connection).
    native_h1: bool = True
    stream_idle_timeout_s: float = 60.0
    ssl_cert_file: str = ""  # SSL_CERT_FILE: trusted for every upstream
    queue_limit: int = 16_384  # attempts an upstream queues before refusing (VELOX_RING_DEPTH)
    ping_interval_s: float = 10.0  # PING an idle HTTP/2 connection this often (0: no PINGs)
    ping_timeout_s: float = 5.0  # a PING unanswered this long: the connection is dead

    @property
    def liveness_tick_s(self) -> float:
        """How often HTTP/2 connections check their liveness (0: never); a connection with
        streams open and no frame for a whole tick gets a PING."""
        if not self.ping_interval_s:
            return 0.0
        return min(1.0, self.ping_interval_s, self.ping_timeout_s / 2)

    @classmethod
    def from_settings(cls, settings: Settings) -> EgressOptions:
        return cls(
            codec=NativeCodec if settings.native else Framer,
            native_h1=settings.native,
            stream_idle_timeout_s=settings.stream_idle_timeout_ms / 1000,
            ssl_cert_file=settings.ssl_cert_file,
            queue_limit=settings.ring_depth,
            ping_interval_s=settings.upstream_ping_interval_ms / 1000,
            ping_timeout_s=settings.upstream_ping_timeout_ms / 1000,
        )


def ssl_context(ca_files: Iterable[str], alpn: list[str]) -> ssl.SSLContext:
    """A verifying client context trusting the system CAs plus `ca_files` (empty ones skipped)."""
    ctx = ssl.create_default_context()
    for extra in ca_files:
        if extra:
            ctx.load_verify_locations(cafile=extra)
    ctx.set_alpn_protocols(alpn)
    return ctx


def make_ssl_context(settings: Settings, alpn: list[str]) -> ssl.SSLContext:
    """The default upstream's context: VELOX_UPSTREAM_CA_FILE and SSL_CERT_FILE add trusted CAs."""
    return ssl_context((settings.upstream_ca_file, settings.ssl_cert_file), alpn)


def next_backoff(previous: float) -> float:
    """Exponential backoff between reconnects, from 50 ms up to 5 s."""
    return min(_BACKOFF_MAX_S, max(_BACKOFF_MIN_S, previous * 2))


class BasePool:
    """The queue and the deadlines; subclasses supply the connections (`_live`)."""

    protocol = ""

    def __init__(self, front: Front, options: EgressOptions) -> None:
        spec = front.spec
        self.front = front
        self.spec = spec
        self.loop = front.loop
        self.tally = front.tally
        self.options = options
        self.size = spec.connections
        self.authority = spec.authority
        self.warmup_path = spec.warmup_path.encode()
        self.warmup_headers = spec.auth_headers()
        self.connect_timeout_s = spec.connect_timeout_ms / 1000
        # Where the connect timeout comes from, for log lines that name it.
        self.connect_timeout_name = ("VELOX_CONNECT_TIMEOUT_MS" if spec.name == DEFAULT_UPSTREAM
                                     else f"connect_timeout_ms of upstream {spec.name!r}")
        self.idle_timeout_s = options.stream_idle_timeout_s
        self.waiting: deque[UpstreamCall] = deque()
        self.closing = False
        self.ready_once = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.timer: asyncio.TimerHandle | None = None
        self.sweep_idle = False  # the sweep sleeps _IDLE_SWEEP_S: no attempt to watch
        self.down_since = 0.0  # monotonic time it was found down; 0.0: up (or not yet known)

    # --- the queue ------------------------------------------------------------------------------

    def _enqueue(self, attempt: UpstreamCall) -> None:
        if len(self.waiting) >= self.options.queue_limit:
            attempt.client.on_error(Overloaded(retry_after_s=1))
            return
        attempt.queue = self.waiting
        self.waiting.append(attempt)

    def _next_waiting(self) -> UpstreamCall | None:
        if not self.waiting:
            return None
        attempt = self.waiting.popleft()
        attempt.queue = None
        return attempt

    def take_waiting(self) -> list[UpstreamCall]:
        taken = []
        while (attempt := self._next_waiting()) is not None:
            taken.append(attempt)
        return taken

    def _fail_waiting(self, exc: VeloxError) -> None:
        for attempt in self.take_waiting():
            attempt.client.on_error(exc)

    # --- tasks and lifecycle --------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _stop(self, exc: VeloxError) -> None:
        self.closing = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for task in list(self.tasks):
            task.cancel()
        self._fail_waiting(exc)

    def connect_error(self, exc: BaseException) -> str:
        """What went wrong, never an empty string: a timeout's str() is ""."""
        if isinstance(exc, TimeoutError):  # asyncio.TimeoutError is TimeoutError since 3.11
            spec = self.spec
            return (f"no connection to {spec.host}:{spec.port} within "
                    f"{spec.connect_timeout_ms} ms ({self.connect_timeout_name})")
        return str(exc) or type(exc).__name__

    def warmup_attempt(self, client: Client) -> UpstreamCall:
        """The warm-up request's attempt: the connect timeout is its deadline, so an upstream
        that accepts the connection but never answers cannot keep it warming forever."""
        if self.sweep_idle:
            self.wake_sweep()
        return UpstreamCall(client, MAX_ATTEMPTS, time.monotonic() + self.connect_timeout_s)

    def warmup_expired(self, what: str) -> None:
        self.tally.warmup_timeout()
        self.went_down(f"{what} did not answer the warm-up request GET "
                       f"{self.warmup_path.decode()} within {self.spec.connect_timeout_ms} ms "
                       f"({self.connect_timeout_name})")

    # --- reachability ---------------------------------------------------------------------------

    def went_down(self, what: str) -> None:
        """A connect or a new connection's warm-up failed (`what` says how): logged when the
        upstream goes down, not for each of the attempts that keep failing after it (a dead
        upstream would otherwise log several lines a second per worker for as long as it
        stays dead)."""
        if self.closing:
            return  # our own shutdown closed it
        if self.down_since:
            log.debug("%s (upstream %r still down)", what, self.spec.name)
            return
        self.down_since = time.monotonic()
        log.warning("%s; upstream %r is down: reconnecting with backoff up to %g s (logged "
                    "again when it answers)", what, self.spec.name, _BACKOFF_MAX_S)

    def came_up(self) -> None:
        """A new connection answered (its warm-up, or a request): the upstream is up."""
        if self.down_since:
            log.info("upstream %r (%s) answers again after %.1f s down", self.spec.name,
                     self.authority, time.monotonic() - self.down_since)
            self.down_since = 0.0

    # --- deadlines ------------------------------------------------------------------------------

    def _live(self) -> Iterator[UpstreamCall]:
        """Every attempt a connection of this pool carries."""
        raise NotImplementedError

    def _tick_s(self) -> float:
        """The sweep's period while attempts run: a quarter of the shortest deadline."""
        shortest = min(self.spec.request_timeout_ms / 1000, self.idle_timeout_s,
                       self.connect_timeout_s)  # the warm-up's deadline
        return min(1.0, max(0.01, shortest / 4), self.options.liveness_tick_s or 1.0)

    def _schedule_sweep(self) -> None:
        tick = self._tick_s()
        rest = self._idle_for(time.monotonic())
        self.sweep_idle = rest > tick
        self.timer = self.loop.call_later(max(tick, rest), self._sweep)

    def _idle_for(self, now: float) -> float:
        """How long the pool has no deadline to watch (0: an attempt waits or runs); the
        next attempt (`wake_sweep`) brings the sweep back to its tick."""
        if self.waiting or next(iter(self._live()), None) is not None:
            return 0.0
        return _IDLE_SWEEP_S

    def wake_sweep(self) -> None:
        """An attempt comes to a pool whose sweep sleeps (`sweep_idle`): its deadlines need
        the tick again."""
        self.sweep_idle = False
        if self.timer is not None and not self.closing:
            self.timer.cancel()
            self.timer = self.loop.call_later(self._tick_s(), self._sweep)

    def _sweep(self) -> None:
        self.tally.timer_wake()
        self.sweep(time.monotonic())
        if not self.closing:
            self._schedule_sweep()

    def sweep(self, now: float) -> None:
        """Fail every attempt past its deadline: no headers by `deadline`, or a stream idle for
        longer than the stream idle timeout. The client hears first, then the attempt is
        cancelled (stream reset, HTTP/1.1 connection closed), unless the client's own reaction
        already ended it (a warm-up that timed out closes its connection)."""
        idle_limit = now - self.idle_timeout_s
        expired = []
        for attempt in (*self._live(), *self.waiting):
            if not attempt.t_headers:
                if attempt.deadline <= now:
                    expired.append((attempt, "response headers"))
            elif attempt.last_activity < idle_limit:
                expired.append((attempt, "the next chunk of the response"))
        for attempt, waiting_for in expired:
            conn = attempt.conn
            attempt.client.on_error(
                UpstreamTimeout(f"The upstream did not send {waiting_for} in time."))
            attempt.cancel()
            if conn is not None and not attempt.t_headers:
                self._headers_timed_out(conn)

    def _headers_timed_out(self, conn: Carrier) -> None:
        """A request on `conn` got no response headers in time (HTTP/2 counts these)."""
