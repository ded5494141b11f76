"""A worker process: one pinned core, one uvloop event loop, the whole pipeline.

Ingress pushes complete requests onto this worker's ring. The first push of a loop pass
schedules one `drain` (not one per request), which pops micro-batches of up to
VELOX_BATCH_MAX with one `pop_batch` call each and runs the stages in order for the batch:
parse (400s), gateway keys (velox.admission.keys: 403/429 per `[[key]]`), the response cache
(velox.cache.front: hits answered, identical requests coalesced; only what goes upstream continues),
one `acquire_up_to` on the shared token bucket for the whole batch (429s for the tail), embeddings
batching (velox.batching.batch), routing, then the egress pool encodes every admitted request and
writes each upstream connection's frames once. Answers come back through the relay. A body of
VELOX_PARSE_OFF_LOOP_BYTES or more is validated in a scanner thread instead of on the loop and
re-enters the ring, parsed, when the scan is done.

The stages are one list (`Worker.stages`: parse, keys, cache, limit, batch, send; a new stage
is one entry) with one entry point, `run(requests, from_stage)`: a batch from the ring starts
at "parse", and the requests a stage held and lets go on (a follower whose leader failed, a
Redis lookup that missed) continue from "limit", those leaving an embeddings batch from
"send-batched". This is the only module that runs the stages in sequence; each stage knows
nothing of the others.

Every request ends through `Request.finish` (velox.core.types), which calls `finished` here:
the one place its body and its key's place go back and it is counted and logged.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any
from urllib.parse import unquote

import orjson

from velox.admission.keys import KeyStage
from velox.admission.parse import (
    parse_messages,
    parse_model_call,
    parse_other,
    scan_model_call,
)
from velox.admission.ratelimit import Limiter
from velox.admission.runtime import RuntimeKeys
from velox.batching.batch import BatchCall, Batcher, Member
from velox.cache.front import CacheFront
from velox.cache.wait import Waiting
from velox.config.settings import Settings
from velox.config.tables import CATCH_ALL, Tables
from velox.core.api import COUNT_TOKENS_PATH, MESSAGES_PATH, OPENAI, client_api
from velox.core.clock import now_ms
from velox.core.errors import ModelNotFound, Overloaded, RateLimited, VeloxError
from velox.core.fields import KIND_STATUS_FIELD, RESPONSE_FIELD, F, H
from velox.core.types import ADMITTED, ENTERABLE, PARSED, SENT, Holder, Kind, Request, Stage
from velox.egress.interfaces import Egress, Tally
from velox.egress.pool import EgressOptions
from velox.egress.upstream import Upstream
from velox.ingress import h1write
from velox.ingress.arena import Arena
from velox.ingress.auth import Auth
from velox.ingress.classify import is_model_list
from velox.ingress.connection import ClientConnection, IngressState
from velox.ingress.ring import Ring
from velox.relay.exchange import Exchange
from velox.relay.messages import MessagesExchange
from velox.relay.usage import Ledger, ReportedMeter, TokenMeter, set_default_output
from velox.relay.usage import use as use_scans
from velox.routing import balance
from velox.routing.dispatch import Dispatch
from velox.spend.traced import Traced
from velox.spend.traced import install as install_tracing
from velox.spend.wire import SharedBudgets, Spend
from velox.state.stats import SharedStats

log = logging.getLogger("velox.worker")

# Batches run per drain before yielding to the loop, so a deep ring cannot starve I/O.
_BATCHES_PER_PASS = 16
_TICK_S = 0.25
# The tick of an idle worker (no client connection, nothing in flight or held, ready): only
# the heartbeat and the gauges have anything to say then, and a beat a second keeps a second
# of margin under the supervisor's 2 s silence bound. Four ticks a second idle were ~1 ms/s
# of CPU a worker; the first tick after a client connects goes back to _TICK_S.
_IDLE_TICK_S = 1.0
# How often a reload's new worker checks whether its upstreams are ready, to start accepting:
# each slot of a reload waits for it, and the check only reads a few attributes.
_ACCEPT_POLL_S = 0.05
# At most one "out of file descriptors" warning per this many seconds per worker.
_FD_WARN_EVERY_S = 10.0
# Kind.FORWARD as a global: an Enum member lookup costs ~0.25 us on Python 3.11
# (EnumType.__getattr__ puts the class on the slow attribute path).
_FORWARD = Kind.FORWARD
_MODEL_OTHER = Kind.MODEL_OTHER
_METERS = (TokenMeter, ReportedMeter)  # without spend
_REQUESTS = int(F.REQUESTS)
_BYTES_OUT = int(F.BYTES_OUT)
_UPSTREAM_REQUESTS = int(F.UPSTREAM_REQUESTS)
_UPSTREAM_ERRORS = int(F.UPSTREAM_ERRORS)
# Once per batch, so once per request at low load: the same plain-int reasoning.
_BATCHES, _BATCH_ITEMS = int(F.BATCHES), int(F.BATCH_ITEMS)
_BATCHES_FULL, _BYTES_IN = int(F.BATCHES_FULL), int(F.BYTES_IN)
_ROOT = Kind.ROOT
# The lifecycle's moves of the hot path, checked in line (velox.core.types.ENTERABLE).
_TO_PARSED, _TO_ADMITTED, _TO_SENT = ENTERABLE[PARSED], ENTERABLE[ADMITTED], ENTERABLE[SENT]


class Worker:
    def __init__(self, settings: Settings, slot: int, shared: SharedStats, limiter: Limiter,
                 sock: Any, defer_accept: bool = False) -> None:
        self.settings = settings
        self.slot = slot
        self.shared = shared
        self.counters = shared.counters
        self.histograms = shared.histograms
        # on_done's three latency records, bound once.
        self._record_total = shared.histograms[H.TOTAL].record
        self._record_upstream = shared.histograms[H.UPSTREAM].record
        self._record_overhead = shared.histograms[H.OVERHEAD].record
        self.limiter = limiter
        self.sock = sock
        # A reload's new worker shares its socket with the worker it replaces, which accepts
        # until this one is ready: it accepts only then (see _accept), so no client meets a
        # worker whose upstreams are not warm, or one that a failed reload is about to kill.
        self.defer_accept = defer_accept
        self.accepting = False
        self.batch_max = settings.batch_max
        self.upstream_root_path = settings.upstream_request_path.encode()
        self.auth = Auth(settings)
        self.keyless = not self.auth.required  # a client's own key may go upstream
        self.drain_pending = False
        self.in_flight = 0
        self.keys: KeyStage | None = None  # made in build()
        self.keys_frame: dict[str, Any] | None = None  # run-time keys at fork (supervisor)
        # Bodies from this size on are validated in a thread (see velox.admission.parse); 0 means
        # never.
        self.off_loop_min = settings.parse_off_loop_bytes or 1 << 62
        self.scanner: ThreadPoolExecutor | None = None  # made at the first large body
        self.stopping: asyncio.Event | None = None
        self.routes = shared.routes
        self.body_timeout_s = settings.body_timeout_ms / 1000
        self.write_timeout_s = settings.write_timeout_ms / 1000
        self.fd_exhausted = False
        self._fd_warned_at = -_FD_WARN_EVERY_S
        # Admin hooks (velox.admin.agent): the control channel's socket, set by the supervisor,
        # and the access log's enqueue, set in serve() unless VELOX_ACCESS_LOG=0.
        self.control_sock: Any = None
        self.fd_sock: Any = None  # key-table segments' descriptors (velox.admin.control)
        self.log_access: Any = None
        self.log_done: Any = None  # the access log's `done`: an exchange's meter has settled
        # Spend (velox.spend.wire): prices, budgets, ledger rows; None with VELOX_SPEND=0. The
        # budgets' shared memory is the supervisor's, set before serve().
        self.budgets: SharedBudgets | None = None
        self.spend: Spend | None = None
        # Who names a request's key by request.key (the access log, the spend's ledger rows):
        # each gets the longer tuple when run-time keys are made (publish_key_names).
        self.key_name_readers: list[Any] = []
        self.key_names: tuple[str, ...] | None = None  # the last published (None: none yet)
        # Traces (velox.spend.traced): None without VELOX_OTEL_ENDPOINT, and then nothing of it
        # runs per request; with it, its hooks replace calls the worker makes anyway.
        self.traced: Traced | None = None
        # Built in serve(), after the process has pinned itself, so memory is node-local.
        self.loop: asyncio.AbstractEventLoop
        self.ring: Any  # the native Ring: it carries Requests, typed as objects
        self.arena: Arena
        self.upstreams: list[Egress]  # one per upstream of settings.tables, in its order
        self.pool: Egress  # upstreams[0] (the only one without VELOX_CONFIG)
        self.dispatch: Dispatch
        self.batcher: Batcher | None  # embeddings batching; None when no route batches
        self.ingress: IngressState
        self.cache: CacheFront | None = None  # built in build() when the shared store exists
        tables = settings.tables
        assert tables is not None  # Settings.__post_init__ synthesises them
        self.tables = tables
        # With a tables file, GET /v1/models lists the routes instead of asking one upstream.
        self.models_body = _model_list(tables) if tables.source else None
        index = {u.name: i for i, u in enumerate(tables.upstreams)}
        self.route_upstreams = tuple(tuple(index[t.upstream] for t in r.targets)
                                     for r in tables.routes)
        self.probe_every_s = tables.breaker.probe_interval_s
        self._next_probe = 0.0
        self._ticker: asyncio.TimerHandle | None = None
        self._idle_ticking = False  # the tick's period is _IDLE_TICK_S (_tick, _busy_tick)

    # --- lifecycle --------------------------------------------------------------------------

    def build(self, loop: asyncio.AbstractEventLoop) -> None:
        """Create the worker's ring, arena, pool and ingress state (first touch happens here,
        so call it after pinning). Split from serve() so the pipeline can run without sockets."""
        settings = self.settings
        self.loop = loop
        self.ring = Ring(settings.ring_depth)
        # VELOX_ARENA_BYTES=0 makes an empty arena: every body then keeps its own buffer.
        self.arena = Arena(settings.arena_bytes)
        # Request.release_body calls the arena's own release: no Worker frame in between
        # (release_segment below is what it replaces, for the Lifecycle protocol's readers).
        self.release_segment = self.arena.release  # type: ignore[method-assign]
        # VELOX_NATIVE=0: the Python response writer instead of the native one (velox.ingress.
        # h1write: module-wide, and this process is this worker's alone), the usage and
        # estimate scans' twins (velox.relay.usage) and the routes' hashing twins (velox.
        # routing.balance; before Dispatch builds the routes).
        h1write.use(native=settings.native)
        use_scans(native=settings.native)
        balance.use(native=settings.native)
        options = EgressOptions.from_settings(settings)
        self.upstreams = [Upstream(spec, options, loop, Tally(self.counters, self.slot))
                          for spec in self.tables.upstreams]
        self.pool = self.upstreams[0]
        self.dispatch = Dispatch(self.tables, self.shared, self.upstreams, self.slot, loop)
        if self.shared.cache is not None:
            self.cache = CacheFront(settings, self.tables, self.shared.cache, loop,
                                    self.counters, self.histograms, self.slot, self)
            if settings.redis_url:  # hosts share answers through Redis (velox.cache.redis)
                from velox.cache.redis import RedisTier

                self.cache.attach_redis(
                    RedisTier(settings.redis_url, settings.cache_redis_timeout_ms,
                              settings.cache_ttl_s * 1000, loop, self.counters, self.slot))
        # The [[key]] stage (velox.admission.keys); None without keys, so keyless gateways skip it.
        self.keys = KeyStage(self.tables, self.shared.keys, self.slot) if self.tables.keys \
            else None
        # Token accounting (velox.relay.usage): every model call when VELOX_TOKEN_ACCOUNTING is on
        # or an upstream has a tpm, else only keyed requests (a key's tpm is settled from usage);
        # None: no meter, nothing read.
        shared = self.shared
        set_default_output(settings.tokens_default_output)
        if settings.spend:
            if self.budgets is not None:
                self.budgets.start_slot(self.slot)
            self.spend = Spend(self.tables, self.budgets, self.slot,
                               settings.tokens_default_output, shared.spend, settings.native)
            self.add_key_name_reader(self.spend)
        # Pricing needs every model call's usage.
        self.meter_all = settings.token_accounting or shared.health.tpm is not None or \
            self.spend is not None
        self.ledger: Ledger | None = None
        if self.meter_all or any(k.tpm for k in self.tables.keys):
            self.want_ledger()
        self.batcher = Batcher(self.tables, self, loop, self.counters, self.slot,
                               self.book_tokens) if Batcher.wanted(self.tables) else None
        if self.batcher is not None:  # the instance attribute shadows the method (as traces'
            self.finished = self._finished_batching  # type: ignore[method-assign]  # wrapper)
        self.stages = self._stage_list()
        self._index_stages()
        self.traced = install_tracing(self, settings)
        # Run-time keys (velox.admission.runtime): the set inherited at fork, then control frames.
        self.runtime_keys = RuntimeKeys(self)
        if self.keys_frame is not None:
            self.runtime_keys.apply(self.keys_frame)
        self.ingress = IngressState(
            loop, self.ring, self.wake_drain, self.arena, self.auth, settings.max_body_bytes,
            settings.max_header_bytes, self.is_ready, self, settings.native,
        )
        self.ingress.after_read = self.after_read
        self.ingress.first_client = self._busy_tick

    def want_ledger(self) -> None:
        """Meter token usage from now on (made at build, or by the first run-time key with a
        tpm)."""
        if self.ledger is None:
            shared = self.shared
            self.ledger = Ledger(shared.tokens, self.slot, shared.route_models,
                                 shared.health.tpm, self.settings.tokens_default_output,
                                 keys=len(self.tables.keys))

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self.build(loop)
        self.stopping = asyncio.Event()
        counters, slot = self.counters, self.slot
        counters.set(slot, F.READY, 0)
        counters.add(slot, F.STARTS, 1)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        loop.add_signal_handler(signal.SIGUSR2, self._hand_off)
        server = None if self.defer_accept else await self._accept()
        for upstream in self.upstreams:
            upstream.start()
        from velox.admin.agent import Agent

        agent = Agent(self)
        await agent.start()
        self._ticker = loop.call_later(_TICK_S, self._tick)
        if server is None:
            server = await self._accept_when_ready()
        # Everything alive now lives as long as the worker: move it out of the collector's
        # sight, so the rare full collections only walk per-request objects. The hot path makes
        # no reference cycles (relay and ingress cut theirs), so refcounting frees requests.
        gc.collect()
        gc.freeze()
        await self.stopping.wait()
        await self.shutdown(server)  # the tick goes on: it expires connections that stall
        agent.close()
        if self.traced is not None:
            self.traced.close()  # bounded: a dead collector does not hold the exit

    async def _accept(self) -> asyncio.AbstractServer:
        server = await self.loop.create_server(
            lambda: ClientConnection(self.ingress), sock=self.sock, backlog=4096)
        self.accepting = True
        return server

    async def _accept_when_ready(self) -> asyncio.AbstractServer | None:
        """Accept once the upstreams are ready (None: told to stop before that). Until then
        the READY gauge stays 0 (_tick), so the supervisor keeps the old worker serving and,
        past VELOX_RELOAD_READY_S, kills this one, leaving every connection queued on the
        shared socket to the old worker."""
        stopping = self.stopping
        assert stopping is not None
        while not self.upstreams_ready():
            if stopping.is_set():
                return None
            await asyncio.sleep(_ACCEPT_POLL_S)
        return await self._accept()

    def _hand_off(self) -> None:
        """SIGUSR2 from the supervisor: a reload's new worker serves this slot now; drain."""
        self.ingress.handoff = True
        self.stopping.set()  # type: ignore[union-attr]

    async def shutdown(self, server: asyncio.AbstractServer | None) -> None:
        """Stop accepting, let in-flight requests finish within the grace period, then close.

        Idle keep-alive connections stay open meanwhile, so a request that arrives on one gets
        a clear 503 shutting_down (with Connection: close) instead of a reset. When handing
        off to a reload's new worker (SIGUSR2), such a request is served instead (with
        Connection: close), and the drain waits for the clients to close their connections
        (up to the grace period): closing an idle keep-alive connection ourselves races with
        a client sending on it, which then fails without an answer.
        """
        state = self.ingress
        state.draining = True
        if server is not None:
            server.close()
        deadline = time.monotonic() + self.settings.shutdown_grace_s
        while time.monotonic() < deadline and (
            len(self.ring) or any(not c.idle for c in state.connections)
            or (state.handoff and state.connections)
        ):
            await asyncio.sleep(0.02)
        left = [c for c in state.connections if not c.idle]
        if left:
            log.warning("grace period over: closing %d connection(s) with requests in flight",
                        len(left))
            for conn in left:
                conn.abort()
        for conn in list(state.connections):
            conn.close_if_idle()
        for upstream in self.upstreams:
            await upstream.close()
        if self.cache is not None and self.cache.tier is not None:
            await self.cache.tier.close()
        if self.scanner is not None:
            self.scanner.shutdown(wait=False)
        self.counters.set(self.slot, F.READY, 0)
        self.counters.set(self.slot, F.IN_FLIGHT, 0)

    def is_ready(self) -> bool:
        if not self.upstreams_ready():
            return False
        counters = self.counters
        # Every serving worker must be warm: any of them may be handed the next connection.
        # Only the active slots count (stats.SharedStats): during a reload the other half of
        # the slots is idle or holds a worker that is starting or draining.
        return all(counters.get(s, F.READY) for s in self.shared.active_slots() if s != self.slot)

    def upstreams_ready(self) -> bool:
        """Ready when every route has a warm upstream whose breaker is closed (one upstream
        without VELOX_CONFIG: when it is warm, as before the tables existed). An upstream at
        its max_in_flight counts as ready: busy is not broken, and a load balancer taking the
        gateway out of service at its busiest would only move the load elsewhere."""
        upstreams = self.upstreams
        if not self.tables.source:
            return upstreams[0].ready
        is_closed = self.shared.health.is_closed
        now = now_ms()
        for route in self.route_upstreams:
            if not any(upstreams[u].ready and is_closed(u, now) for u in route):
                return False
        return True

    def _tick(self) -> None:
        counters, slot = self.counters, self.slot
        ready = self.accepting and self.upstreams_ready()
        counters.add(slot, F.TIMER_WAKES, 1)
        counters.set(slot, F.READY, 1 if ready else 0)
        counters.set(slot, F.IN_FLIGHT, self.in_flight)
        counters.set(slot, F.RING_DEPTH, len(self.ring))
        counters.set(slot, F.UPSTREAM_CONNECTIONS,
                     sum(u.open_connections for u in self.upstreams))
        if self.ingress.overloaded:
            counters.add(slot, F.REJECT_RING_FULL, self.ingress.overloaded)
            self.ingress.overloaded = 0
        counters.set(slot, F.HEARTBEAT_MS, now_ms())  # the supervisor's hang watch
        spend = self.spend
        if spend is not None:
            if spend.held:
                spend.sweep()  # reservations of clients gone before an exchange
            if spend.feed is not None:
                spend.feed.kick()  # the book's rows: their flush armed (ledgerfeed)
        now = time.monotonic()
        idle_before = now - self.settings.keepalive_timeout_s
        late_before = now - self.body_timeout_s
        stalled_before = now - self.write_timeout_s
        for conn in [c for c in self.ingress.connections
                     if c.last_active < idle_before or 0.0 < c.receiving_since < late_before
                     or 0.0 < c.stalled_since < stalled_before]:
            if 0.0 < conn.stalled_since < stalled_before:
                conn.expire_write()
            elif 0.0 < conn.receiving_since < late_before and not conn.read_paused:
                conn.expire_receive()
            else:
                conn.close_if_idle()
        ingress = self.ingress
        if ingress.receive_timeouts:
            counters.add(slot, F.RECEIVE_TIMEOUTS, ingress.receive_timeouts)
            ingress.receive_timeouts = 0
        if ingress.write_timeouts:
            counters.add(slot, F.WRITE_TIMEOUTS, ingress.write_timeouts)
            ingress.write_timeouts = 0
        self._probe_fds(now)
        if now >= self._next_probe:  # breakers past their open time get a background probe
            self._next_probe = now + self.probe_every_s
            self.dispatch.probe()
        self.dispatch.log_breakers()
        if self.traced is not None:
            self.traced.tick()
        self._idle_ticking = bool(ready and self._idle())
        self._ticker = self.loop.call_later(_IDLE_TICK_S if self._idle_ticking else _TICK_S,
                                            self._tick)

    def _busy_tick(self) -> None:
        """A client connected while the tick was idle: the next tick within _TICK_S, so the
        connection's deadlines (keep-alive, body, write) are checked as often as ever."""
        if self._idle_ticking and self._ticker is not None:
            self._idle_ticking = False
            self._ticker.cancel()
            self._ticker = self.loop.call_later(_TICK_S, self._tick)

    def _idle(self) -> bool:
        """Nothing for the tick to watch but the heartbeat: no client connection (no
        keep-alive, body or write deadline runs), nothing in flight or in the ring, no
        reservation held."""
        spend = self.spend
        return not (self.ingress.connections or self.in_flight or len(self.ring)
                    or (spend is not None and spend.held))

    def _probe_fds(self, now: float) -> None:
        """Notice when the worker is out of file descriptors. uvloop (libuv's EMFILE trick)
        then accepts and closes new clients without telling Python anything, so the worker
        looks for itself: one dup() per tick. Episodes shorter than a tick can be missed."""
        try:
            os.close(os.dup(self.sock.fileno()))
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                return
            if not self.fd_exhausted:
                self.fd_exhausted = True
                self.counters.add(self.slot, F.FD_EXHAUSTED, 1)
                if now - self._fd_warned_at >= _FD_WARN_EVERY_S:
                    self._fd_warned_at = now
                    log.warning(
                        "worker %d is out of file descriptors (%s, %d client connections): "
                        "new clients are being reset until some close; raise RLIMIT_NOFILE "
                        "(ulimit -n)", self.slot, errno.errorcode[exc.errno],
                        len(self.ingress.connections))
            return
        if self.fd_exhausted:
            self.fd_exhausted = False
            log.info("worker %d has file descriptors again; accepting new clients", self.slot)

    # --- the pipeline -------------------------------------------------------------------------

    def wake_drain(self) -> None:
        if not self.drain_pending:
            self.drain_pending = True
            self.loop.call_soon(self.drain)

    def after_read(self, pushed: int) -> None:
        """A client read pushed `pushed` requests. One, with nothing else in the ring or in
        flight (one client at a time: nothing could join its batch), is drained now, inside
        the read's callback: a call_soon hop costs ~0.7 us on uvloop (a handle, the idle
        handler, the ready queue), and at one connection the e2e CPU per request went down
        ~2% (benches/e2e/streamscale.py --plain, 14 interleaved rounds, within the host's
        noise). Anything else is left to the drain at the end of the loop pass, so that the
        reads of many connections in one pass still form one micro-batch (under load the
        worker always has requests in flight)."""
        if pushed == 1 and not self.in_flight and not self.drain_pending and \
                len(self.ring) == 1:
            self.drain()
        else:
            self.wake_drain()

    def drain(self) -> None:
        """Up to _BATCHES_PER_PASS micro-batches from the ring, each through every stage
        (`run` from "parse"), the current arena segment rewound after each."""
        self.drain_pending = False
        ring = self.ring
        counters, slot, batch_max = self.counters, self.slot, self.batch_max
        run, reset = self.run, self.arena.reset
        for _ in range(_BATCHES_PER_PASS):
            batch = ring.pop_batch(batch_max)
            if not batch:
                return
            # (one batch: what a separate `process` frame did, once per request at one client)
            size = len(batch)
            counters.add(slot, _BATCHES, 1)
            counters.add(slot, _BATCH_ITEMS, size)
            if size == batch_max:
                counters.add(slot, _BATCHES_FULL, 1)
            run(batch, "parse")
            reset()
        if len(ring):
            self.wake_drain()

    # The stages a batch of requests goes through, in order: each takes the requests that
    # reached it and returns those that go on (the others it answered, or holds to continue
    # later through `run`). A new stage (a guardrail, a translation) is one entry here.
    def _stage_list(self) -> list[tuple[str, Stage]]:
        stages: list[tuple[str, Stage]] = [("parse", self._parse)]
        if self.keys is not None:
            # 403 for a model the key may not use, the key's rpm / tpm / max_parallel (429).
            # Before the cache: a hit counts against the caller's own request limit.
            stages.append(("keys", self.keys.run))
            spend = self.spend
            if spend is not None and spend.budgets:  # 429 insufficient_quota for spent budgets
                stages.append(("budget", spend.run))
        if self.cache is not None:  # hits answered here; followers wait for their leader
            stages.append(("cache", self.cache.front))
        stages.append(("limit", self._limit))
        if self.batcher is not None:  # embeddings calls join a batch (velox.batching.batch)
            stages.append(("batch", self._batch))
        stages.append(("send", self._send_on))
        if self.batcher is not None:
            # What leaves a batch enters here: after "send", which passes nothing on.
            stages.append(("send-batched", self._send_batched))
        return stages

    def keys_stage(self) -> KeyStage:
        """The keys stage, made and put in the stage list (before the cache: a hit counts
        against the caller's own limits) by the first run-time key of a gateway that has no
        [[key]] tables."""
        if self.keys is None:
            self.keys = KeyStage(self.tables, self.shared.keys, self.slot)
            names = [n for n, _ in self.stages]
            self.add_stage("keys", self.keys.run, "cache" if "cache" in names else "limit")
        return self.keys

    def publish_key_names(self, names: tuple[str, ...]) -> None:
        """Run-time keys have their places in request.key's names (KeyNames): whoever names a
        request's key reads the longer tuple from now on (one attribute store each)."""
        self.key_names = names
        for reader in self.key_name_readers:
            if reader.key_names is not names:
                reader.key_names = names

    def add_key_name_reader(self, reader: Any) -> None:
        """`reader` (with a `key_names` attribute) follows the published names from now on,
        starting with those published already (run-time keys inherited at fork)."""
        self.key_name_readers.append(reader)
        if self.key_names is not None:
            reader.key_names = self.key_names

    def add_stage(self, name: str, stage: Stage, before: str) -> None:
        """Insert a stage in front of the one named `before`."""
        at = [n for n, _ in self.stages].index(before)
        self.stages.insert(at, (name, stage))
        self._index_stages()

    def replace_stage(self, name: str, stage: Stage) -> None:
        """Run `stage` in place of the stage named `name` (a hook around it: traces)."""
        self.stages = [(n, stage if n == name else s) for n, s in self.stages]
        self._index_stages()

    def _index_stages(self) -> None:
        # Each stage's name -> it and the stages after it: run() does one dict lookup a batch
        # (a scan and a slice cost ~0.5 us a batch, seen at one request a batch).
        stages = self.stages
        self._from = {name: tuple(s for _, s in stages[i:]) for i, (name, _) in
                      enumerate(stages)}

    def run(self, requests: list[Request], from_stage: str) -> None:
        """The one entry of the pipeline: `requests` through the stages from `from_stage` on
        (a batch from the ring from "parse"; those the cache held, from "limit"; what leaves
        an embeddings batch, from "send-batched"), then every upstream writes what was
        submitted."""
        for stage in self._from[from_stage]:
            requests = stage(requests)
            if not requests:
                break
        for upstream in self.upstreams:
            upstream.flush()

    def _parse(self, batch: list[Request]) -> list[Request]:
        """400 for a body that is not a valid call; a large body goes to the scanner thread
        and comes back through the ring, parsed."""
        now = time.perf_counter_ns()
        parsed: list[Request] = []
        bytes_in = 0
        for request in batch:
            if request.conn.closed:
                continue  # the client left while it was queued: ingress finished it
            # A request whose model is known was scanned off the loop and came back: its
            # bytes are counted and its t_popped kept, so its parse time includes the scan.
            if request.model is None:
                request.t_popped = now
                bytes_in += len(request.body)
                kind = request.kind
                if kind is not _FORWARD:
                    if kind is not _MODEL_OTHER and len(request.body) >= self.off_loop_min:
                        self._scan_off_loop(request)
                        continue
                    try:
                        if kind is _MODEL_OTHER:
                            parse_other(request)
                        elif request.path.startswith(MESSAGES_PATH):  # velox.core.api
                            parse_messages(request, client_api(request.path))
                        else:
                            parse_model_call(request)
                    except VeloxError as exc:
                        request.conn.respond_error(request, exc)
                        continue
                if not (_TO_PARSED >> request.state) & 1:  # request.advance, in line
                    raise request.illegal(PARSED)
                request.state = PARSED
            if request.kind is _ROOT:
                request.upstream_path = self.upstream_root_path
            parsed.append(request)
        self.counters.add(self.slot, _BYTES_IN, bytes_in)
        return parsed

    def _limit(self, parsed: list[Request]) -> list[Request]:
        """The shared request bucket: one acquire for the batch, 429 for its tail."""
        t_parsed = time.perf_counter_ns()
        admitted = self.limiter.take(len(parsed))
        t_admitted = time.perf_counter_ns()
        if admitted < len(parsed):
            self._refuse_rate_limited(parsed[admitted:])
            parsed = parsed[:admitted]
        for request in parsed:
            request.t_parsed = t_parsed
            request.t_admitted = t_admitted
            if not (_TO_ADMITTED >> request.state) & 1:  # request.advance, in line
                raise request.illegal(ADMITTED)
            request.state = ADMITTED
        return parsed

    def _batch(self, admitted: list[Request]) -> list[Request]:
        """Embeddings batching (velox.batching.batch): a request the batcher takes is BATCHED
        (the batcher moves it) and in flight from now; it ends answered its part of a merged
        call, or leaves the batch through run(..., "send") as its own request. A request the
        cache is recording goes alone: its answer must pass its observer."""
        batcher = self.batcher
        assert batcher is not None  # the stage is listed only with a batcher
        rest: list[Request] = []
        for request in admitted:
            if request.cache is None and batcher.offer(request):
                self.in_flight += 1
            else:
                rest.append(request)
        return rest

    def _send_on(self, admitted: list[Request]) -> list[Request]:
        """The last stage: the model list answered here, a cached miss leads or follows an
        identical call, the rest go through dispatch."""
        cache = self.cache
        dispatch = self.dispatch
        models_body = self.models_body
        on_done = self.on_done  # bound once per batch, not per request
        for request in admitted:
            if models_body is not None and request.kind is _FORWARD and \
                    is_model_list(request.method, request.path):
                self._answer_models(request)
                continue
            ticket = request.cache
            if ticket is not None and cache is not None and cache.follows(request):
                request.advance(SENT)  # an identical request of this batch is being sent:
                continue  # it waits for that one's answer
            if not (_TO_SENT >> request.state) & 1:  # request.advance, in line
                raise request.illegal(SENT)
            request.state = SENT
            exchange = self._exchange(request, on_done)
            if ticket is not None and cache is not None:
                cache.observe(exchange)  # records the answer, serves those who wait for it
            self.in_flight += 1
            dispatch.send(exchange)
        return []

    def _send_batched(self, leaving: list[Request]) -> list[Request]:
        """What leaves an embeddings batch, BATCHED -> SENT, through dispatch: a member on its
        own (in flight since the batch took it), or a merged call, which is no client's
        request (the worker accounts for its members; its end is its own, BatchCall's)."""
        dispatch = self.dispatch
        for request in leaving:
            request.advance(SENT)
            alone = type(request.conn) is not BatchCall
            dispatch.send(self._exchange(request, self.on_done if alone else _unaccounted))
        return []

    def _exchange(self, request: Request, on_done: Any) -> Exchange:
        """The relay exchange of a request about to be sent: the client's headers apart from
        its credential, and a token meter when anyone accounts for it (velox.relay.usage)."""
        prepared = request.upstream_headers  # made by ingress's native head parser
        base, passthrough = self.auth.client_headers(request.headers) if prepared is None \
            else prepared
        if request.path.startswith(MESSAGES_PATH) and client_api(request.path) != OPENAI:
            # The Anthropic Messages API in front (velox.relay.messages): its client credential
            # header is dropped like Authorization, its answers translated per target.
            exchange: Exchange = MessagesExchange(request, base, passthrough,
                                                  self.keyless, on_done, self.dispatch)
        else:
            exchange = Exchange(request, request.upstream_path, base, on_done, self.dispatch)
            exchange.passthrough = passthrough
        ledger = self.ledger
        if ledger is not None and request.kind is not _FORWARD and (
                self.meter_all or request.ticket is not None):
            spend = self.spend  # its meters price too (velox.spend.wire.PricedMeter)
            metered, reported = _METERS if spend is None else spend.meters
            # images, audio, count_tokens: only what the answer reports
            if request.kind is _MODEL_OTHER or request.path.startswith(COUNT_TOKENS_PATH):
                exchange.meter = reported(ledger, request)
            elif request.stream:  # asked for its usage unless the client asked
                exchange.meter = metered.for_request(ledger, request)
            else:  # most settle early: only the counters need the numbers (TokenMeter.early)
                exchange.meter = metered(ledger, request)
        return exchange

    def _answer_models(self, request: Request) -> None:
        """GET /v1/models[/ID] with a tables file: the routes' public names, OpenAI's shape."""
        path = request.path.split(b"?", 1)[0]
        if path == b"/v1/models":
            request.conn.respond(request, 200, _JSON, self.models_body)  # type: ignore[arg-type]
            return
        name = unquote(path[len(b"/v1/models/"):].decode("latin-1"))
        if any(r.model == name for r in self.tables.routes if r.model != CATCH_ALL):
            request.conn.respond(request, 200, _JSON, orjson.dumps(_model_object(name)))
        else:
            request.conn.respond_error(request, ModelNotFound(
                f"The model `{name}` does not exist or you do not have access to it.",
                param="model"))

    def _scan_off_loop(self, request: Request) -> None:
        """Validate a large body in the scanner thread; the request re-enters the ring after."""
        if self.scanner is None:
            self.scanner = ThreadPoolExecutor(1, thread_name_prefix=f"velox-scan-{self.slot}",
                                              initializer=_lower_priority)
        future = self.loop.run_in_executor(self.scanner, scan_model_call, request.body)
        future.add_done_callback(partial(self._scanned, request))

    def _scanned(self, request: Request, future: asyncio.Future[tuple[str, bool]]) -> None:
        if future.cancelled():  # the loop is closing
            return
        conn = request.conn
        if conn.closed:
            return  # ingress finished it when its client left
        exc = future.exception()
        if exc is not None:
            conn.respond_error(request, exc)
            return
        request.model, request.stream = future.result()
        request.advance(PARSED)
        if self.ring.try_push(request):
            self.wake_drain()
        else:
            self.ingress.overloaded += 1
            conn.respond_error(request, Overloaded(retry_after_s=1))

    def _refuse_rate_limited(self, requests: list[Request]) -> None:
        retry_after = self.limiter.retry_after_s()
        self.counters.add(self.slot, F.REJECT_RATE_LIMITED, len(requests))
        error = RateLimited(retry_after_s=retry_after)
        for request in requests:
            if request.ticket is not None:
                request.ticket.settle(0)  # refused before the upstream: no tokens used
            request.conn.respond_error(request, error)

    # --- accounting callbacks ----------------------------------------------------------------

    # --- the request's end (core.types.Lifecycle) ----------------------------------------

    def release_segment(self, segment: int) -> None:
        self.arena.release(segment)

    def finished(self, request: Request, status: int, bytes_out: int,
                 holder: Holder | None) -> None:
        """Request.finish: the request is over, whichever way (answered, refused, its client
        gone before or during the answer, its connection cut by a timeout or the shutdown):
        its body and its key's place go back, it is counted and logged, once."""
        if request.arena_segment >= 0:  # (an answered request gave it back at its commit point)
            request.release_body()
        ticket = request.ticket
        if ticket is not None and not ticket.released:  # the answer is written: the key's
            ticket.release()  # place goes back
        spend = self.spend
        if spend is not None and spend.held:  # answered without a priced exchange
            spend.answered(request)
        slot = self.slot
        cls = status // 100
        # The request's three counters in one native call.
        self.counters.add_many(slot, _REQUESTS, 1,
                               RESPONSE_FIELD[cls] if 0 <= cls < 10 else RESPONSE_FIELD[9], 1,
                               _BYTES_OUT, bytes_out)
        self.routes.add(slot, KIND_STATUS_FIELD[request.kind][cls], 1)
        log_access = self.log_access
        if log_access is not None:  # its record: the log's timer formats and writes
            if holder is not None and type(holder) is Waiting:
                holder = None  # a cache follower's client left: no call of its own to log
            log_access((time.perf_counter_ns(), request, holder, status, bytes_out))

    def _finished_batching(self, request: Request, status: int, bytes_out: int,
                           holder: Holder | None) -> None:
        """`finished` when a route batches: a member answered by its batch, or whose client
        left while it was batched, also ends its place in flight and its latencies, as
        on_done does for an exchange (its holder is its Member then)."""
        if type(holder) is Member:
            self.on_done(holder, status)
        Worker.finished(self, request, status, bytes_out, holder)

    def book_tokens(self, request: Request, inp: int, out: int, exchange: Any = None) -> None:
        """A batched member's share of its merged call's usage, into its own key's books (the
        merged call's meter books nothing), when its tokens are accounted (as _exchange's
        meter would be); priced as its own request (the merged call is not)."""
        ledger = self.ledger
        if ledger is not None and (self.meter_all or request.ticket is not None):
            ledger.count(request, inp, out)
        if self.spend is not None and exchange is not None:
            self.spend.member(request, inp, out, exchange)

    def on_done(self, exchange: Exchange | Member, status: int) -> None:
        """An upstream exchange (or a batch member's share of one) is over: in flight and the
        latency histograms. The request's own end is `finished`."""
        self.in_flight -= 1
        log_done = self.log_done
        if log_done is not None:  # its request's line waits for the settled meter
            log_done(exchange)
        if not exchange.t_headers:
            if status >= 500:
                self.counters.add(self.slot, _UPSTREAM_ERRORS, 1)
            return
        now = time.perf_counter_ns()
        request = exchange.request
        if exchange.streaming:
            total = exchange.t_headers - request.t_received
            upstream = exchange.t_headers - exchange.t_sent
        else:
            total = now - request.t_received
            upstream = now - exchange.t_sent
        slot = self.slot
        self._record_total(slot, total // 1000)
        self._record_upstream(slot, upstream // 1000)
        self._record_overhead(slot, (total - upstream) // 1000)
        self.counters.add(slot, _UPSTREAM_REQUESTS, 1)


def _unaccounted(exchange: Exchange, status: int) -> None:
    """A merged batch call's exchange is over: its request's end is its own (BatchCall); the
    worker accounts for its members, one by one."""


def _lower_priority() -> None:
    """Run the calling thread at nice +10: sharing its core with the event loop, it then yields
    the core whenever the loop has work, instead of taking turns of a few milliseconds."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except OSError:  # not permitted here: the scan still runs, at normal priority
        pass


_JSON = ((b"content-type", b"application/json"),)


def _model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "velox"}


def _model_list(tables: Tables) -> bytes:
    return orjson.dumps({"object": "list", "data": [
        _model_object(r.model) for r in tables.routes if r.model != CATCH_ALL]})
