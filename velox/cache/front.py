"""Response cache: answers served again without the upstream, and identical requests in flight
coalesced into one upstream call.

One store for the whole gateway (`velox._native.SharedCache`, one shared mapping the supervisor
creates before it forks, like the token bucket), so a prompt is missed once per gateway, not
once per worker, and held once. Each worker runs a `CacheFront` in its pipeline, after parsing
and before the global rate limiter (worker.process):

* `front(batch)`: every model call of a cached route (VELOX_CACHE=1: all; else `cache = true`
  in VELOX_CONFIG) gets a key; a stored answer is written at once (`x-velox-cache: hit`, `age`),
  without the limiter's upstream quota and without dispatch. A request whose key is already
  being fetched waits for that answer instead (below). The rest continue as misses.
* `follows(request)` / `observe(exchange)`, after admission: a miss whose key was taken by an
  earlier request of the same batch follows it; otherwise its `relay.Exchange` gets an
  observer (`Flight`) that records the committed answer, stores it if it is a complete 200 whose
  body is what its content type says (JSON that parses; an event stream that ended with
  `data: [DONE]` and carries no error event), and serves the requests that wait for it.

The key (`cache_key`): BLAKE2b-256 over the path (query included), the model the client named,
the caller's identity (auth.caller_of: SHA-256 of the credential it presented; one tenant is
never served another's answer), whether it streams, and the body in canonical form
(`canonical_body`: orjson with sorted keys, no insignificant whitespace, without `user`,
`stream_options` and `metadata`).

Client controls (`cache_control`, request header Cache-Control): `no-cache` skips the lookup and
stores the fresh answer (it follows no request in flight); `no-store` neither looks up nor
stores (nor leads or follows); `max-age=N` accepts only entries at most N seconds old.

Coalescing. Within a worker, requests with the key of a `Flight` in progress attach to it as
followers: a streamed answer gives them the events so far, then the rest live; a whole one is
written to each when it completes (one body object for all of them). Across workers, the
leader holds the store's in-flight marker (`claim`) and requests in other workers wait for the
entry to appear (`RemoteWait`, polled at 1, 2, 4 ... up to 20 ms intervals, up to the
upstream's request timeout). The marker
is a lease of `LEASE_MS` on the leader's pid, which the leader's worker renews every
`RENEW_S` while its call runs: a leader whose worker died (the store sees its pid gone once the
supervisor reaps it) or stopped renewing (stopped, stuck) no longer holds the key, and its
waiters go on their own within a poll or at most one lease, not after the request timeout; streamed
requests do not wait across workers (the entry appears only once the stream is complete, which
would take their first byte to the end of the stream). A follower whose leader fails (no
answer, or one that is not a 200) is sent on its own (`send_alone`: on through the worker's stages
from the limiter); one whose
leader's stream broke after it started gets the same broken ending as the leader's client. A
client that disconnects never cancels an upstream call that others wait for: the call runs on
without it (`client_gone`), and is cancelled only when no one is left.

Slow clients. Answers are written as the client takes them (ingress's send queue: slices of the
answer itself, no copy per client), and a client that takes nothing for VELOX_WRITE_TIMEOUT_MS
is disconnected. A hit's answer is copied out of the shared store once per worker while it is
being written: hits of the same key meanwhile are written from that copy (`Replay`, while any
client is still being written it, within the entry's TTL and the request's max-age), so many
clients asking for one large answer and not reading hold it once between them, not once each.
The followers of a live stream go at the leader's pace (egress takes the upstream's data as the
leader's client takes it); a follower whose client falls more than `FOLLOWER_LAG_BYTES` behind
the stream (beyond the events it was given when it joined) is cut off: its connection is
aborted, as a client that cannot keep up with a live stream must be (its answer cannot be
restarted on its own call once part of it was sent), and counted (`followers_cut`).

With VELOX_REDIS_URL a Redis tier sits behind the local store (velox.cache.redis, attached by
the worker): a local miss with nothing in flight for its key on this host asks Redis (within
VELOX_CACHE_REDIS_TIMEOUT_MS) before it goes on, and stored answers are written there too.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from velox.cache.store import (
    BYPASS,
    CACHEABLE_PATHS,
    EVENT_STREAM,
    HEADER,
    HIT,
    MISS,
    Replay,
    Store,
    cache_control,
    cache_key,
    canonical_body,
    decode_entry,
    encode_entry,
    storable,
    stored_headers,
)
from velox.cache.wait import FOLLOWER_LAG_BYTES, Waiting, WaitList, usage_filter
from velox.config.tables import CATCH_ALL, Tables
from velox.core.clock import now_ms
from velox.core.errors import UpstreamProtocolError, to_response
from velox.core.fields import F, H
from velox.core.types import CacheIntent, Headers, Kind, Pipeline, Request
from velox.ingress.auth import caller_of
from velox.ingress.connection import WHOLE_BYTES
from velox.relay.usage import SSEUsage

if TYPE_CHECKING:
    from velox.cache.redis import RedisTier
    from velox.config.settings import Settings
    from velox.relay.exchange import Exchange

log = logging.getLogger("velox.cache")

# Cross-worker followers poll the store at growing intervals: 1, 2, 4, 8, 16, 20, 20 ... ms.
_POLL_FIRST_S = 0.001
_POLL_MAX_S = 0.020
# The in-flight marker's lease and how often a leader's worker renews it: a dead leader's
# pid frees its key at once (once reaped); a leader that stops renewing (its worker stopped or
# its loop stuck for 5 s) frees it after one lease, and its waiters are then sent alone (a
# duplicate upstream call at worst, never a lost answer). 5 renewals per lease: a renewal may
# come late by 4 s of loop stall before the lease lapses.
LEASE_MS = 5000
RENEW_S = 1.0
_AGES = tuple(b"%d" % n for n in range(64))


def _free(request: Request) -> None:
    """Answered without an upstream call of its own (a hit, a coalesced follower): the
    tokens its gateway key reserved at admission (velox.admission.keys) go back; the request itself
    still counted against the key's request limit."""
    ticket = request.ticket
    if ticket is not None:
        ticket.settle(0)


def _without_usage(body: bytes | memoryview) -> bytes:
    """A whole recorded event stream without its usage chunk (usage_filter's filter)."""
    usage = SSEUsage(True)
    return usage.feed(bytes(body)) + usage.flush()


def _age(age_ms: int) -> bytes:
    seconds = age_ms // 1000
    return _AGES[seconds] if seconds < len(_AGES) else b"%d" % seconds


# --- per request -------------------------------------------------------------------------------


class Intent:
    """A cached route's model call on its way (request.cache)."""

    __slots__ = ("key", "follow", "store", "max_age_ms", "alone", "marker")

    def __init__(self, key: bytes, follow: bool, store: bool, max_age_ms: int = -1) -> None:
        self.key = key  # b"" for a bypass
        self.follow = follow  # may look up, lead or follow an identical request in flight
        self.store = store  # its answer may be stored
        self.max_age_ms = max_age_ms  # Cache-Control max-age; -1: any fresh entry
        self.alone = False  # sent on its own after its leader failed
        self.marker = False  # took the store's in-flight marker: it leads across workers


_BYPASS = Intent(b"", False, False)


class _Detached:
    """Where a leader's exchange writes once its client has left (a Responder doing nothing)."""

    closed = True
    write_paused = False
    queued = 0

    def respond(self, request: Request, status: int, headers: Sequence[tuple[bytes, bytes]],
                body: bytes | memoryview) -> None:
        pass

    def respond_error(self, request: Request, exc: BaseException) -> None:
        pass

    def start_stream(self, request: Request, status: int,
                     headers: Sequence[tuple[bytes, bytes]]) -> None:
        pass

    def send_chunk(self, data: bytes) -> None:
        pass

    def end_stream(self) -> None:
        pass

    def abort(self) -> None:
        pass


_DETACHED = _Detached()


class _Tag:
    """The observer of a bypass: it only says so in the answer's headers."""

    def head(self, status: int, headers: Headers) -> None:
        headers.append((HEADER, BYPASS))

    def data(self, data: bytes) -> None:
        pass

    def end(self, error: BaseException | None) -> None:
        pass

    def client_gone(self, exchange: Exchange) -> bool:
        return False


_TAG = _Tag()


class Flight:
    """One upstream call whose answer is recorded (and stored), with the requests waiting for
    it. The relay's observer of that call's exchange."""

    __slots__ = ("front", "key", "exchange", "intent", "status", "headers", "chunks", "size",
                 "sse", "tail", "overflow", "followers", "marker", "registered", "leader_gone")

    def __init__(self, front: CacheFront, exchange: Exchange, intent: CacheIntent) -> None:
        self.front = front
        self.key = intent.key
        self.exchange: Exchange | None = exchange
        self.intent = intent
        self.status = 0
        self.headers: Headers = []  # as stored: without the gateway's own and momentary ones
        self.chunks: list[bytes] = []
        self.size = 0
        self.sse = False
        self.tail = b""  # the last two bytes recorded: b"\n\n" ends an event
        self.overflow = False  # recorded past the store's max_value: not stored, no new followers
        self.followers: list[Waiting] = []
        self.marker = False  # holds the store's in-flight marker (cross-worker coalescing)
        self.registered = False  # in front.flights: identical requests of this worker follow it
        self.leader_gone = False

    @property
    def joinable(self) -> bool:
        return not self.overflow and (self.status == 0 or (self.status == 200 and self.sse))

    def join(self, request: Request) -> None:
        waiting = Waiting(self, request)
        request.exchange = waiting
        self.followers.append(waiting)
        if self.status == 200 and self.sse:  # the stream is under way: events so far, then live
            self._start(waiting)
            waiting.lag = self.size + FOLLOWER_LAG_BYTES
            for chunk in self.chunks:  # the recorded pieces themselves: shared, not copied
                waiting.send(chunk)

    def leave(self, waiting: Waiting) -> None:
        """A follower's client left."""
        try:
            self.followers.remove(waiting)
        except ValueError:
            return
        waiting.request.exchange = None  # its end (Request.finish) gives its body back
        exchange = self.exchange
        if self.leader_gone and exchange is not None and not self._others_wait():
            exchange.client_gone()  # no one is left: cancel the upstream call

    def _others_wait(self) -> bool:
        return bool(self.followers) or (self.marker and self.front.store.waiting(self.key) > 0)

    # --- relay.Observer ----------------------------------------------------------------------

    def head(self, status: int, headers: Headers) -> None:
        self.status = status
        self.headers = stored_headers(headers)
        headers.append((HEADER, MISS))
        for name, value in headers:
            if name == b"content-type":
                self.sse = value.startswith(EVENT_STREAM)
                break
        if status == 200 and self.sse:
            for waiting in self.followers:
                self._start(waiting)

    def data(self, data: bytes) -> None:
        if not data:
            return
        if not self.overflow:
            self.size += len(data)
            if self.size > self.front.max_value and (self.sse or not self.followers):
                # Too large to store: forget it (streaming followers have it all already).
                self.overflow = True
                self.chunks = []
            else:
                self.chunks.append(data)
        self.tail = data[-2:] if len(data) > 1 else self.tail[-1:] + data
        if self.status == 200 and self.sse:
            behind = [w for w in self.followers if not w.send(data)]
            for waiting in behind:
                self.cut(waiting)

    def cut(self, waiting: Waiting) -> None:
        """A follower's client fell too far behind the live stream: its connection is aborted
        (the client sees the stream end without `[DONE]`) and it follows no more."""
        waiting.request.conn.abort()
        self.front.counters.add(self.front.slot, F.CACHE_FOLLOWERS_CUT, 1)
        self.leave(waiting)

    def end(self, error: BaseException | None) -> None:
        front = self.front
        if self.registered and front.flights.get(self.key) is self:
            del front.flights[self.key]
        self.registered = False
        self.exchange = None
        body = b"".join(self.chunks)
        self.chunks = []
        ok = error is None and self.status == 200
        if ok and self.intent.store and not self.overflow and storable(
                self.status, self.headers, body):
            front.put(self.key, encode_entry(self.sse, self.headers, body))
        if self.marker:
            self.marker = False
            front.unhold(self.key)
        followers = self.followers
        if not followers:
            return
        self.followers = []
        if ok and self.sse:
            for waiting in followers:
                request = waiting.request
                request.exchange = None
                _free(request)
                waiting.end_stream()
            front.coalesced(len(followers))
        elif ok:
            headers = [*self.headers, (HEADER, HIT), (b"age", b"0")]
            for waiting in followers:
                request = waiting.request
                request.exchange = None
                _free(request)
                request.conn.respond(request, 200, headers, body)
            front.coalesced(len(followers))
        elif self.status == 200 and self.sse and followers[0].started:
            # Broken after the stream started: what the leader's client got (relay.on_error).
            event = b"data: %b\n\n" % to_response(error or UpstreamProtocolError()).body
            for waiting in followers:
                request = waiting.request
                request.exchange = None
                if self.tail in (b"", b"\n\n"):
                    request.conn.send_chunk(event)
                    request.conn.end_stream()
                else:
                    request.conn.abort()
            front.coalesced(len(followers))
        else:
            front.send_alone([w.request for w in followers])

    def client_gone(self, exchange: Exchange) -> bool:
        if not self._others_wait():
            return False
        self.leader_gone = True
        exchange.conn = _DETACHED  # the answer still reaches the followers and the store
        return True

    def _start(self, waiting: Waiting) -> None:
        waiting.started = True
        request = waiting.request
        request.conn.start_stream(request, 200, [*self.headers, (HEADER, HIT), (b"age", b"0")])


class RemoteWait(WaitList["CacheFront"]):
    """Requests of this worker waiting for an identical request another worker leads: they
    poll the store until the entry appears (answered as coalesced), the marker disappears
    without one or the upstream's request timeout passes (then each is sent on its own)."""

    __slots__ = ("delay", "deadline")

    def __init__(self, front: CacheFront, key: bytes, deadline: float) -> None:
        super().__init__(front, key)
        self.delay = _POLL_FIRST_S
        self.deadline = deadline
        self.timer = front.loop.call_later(self.delay, self.poll)

    def emptied(self) -> None:
        self.take()  # no one is left to poll for

    def closed(self) -> None:
        front = self.front
        if front.waits.get(self.key) is self:
            del front.waits[self.key]
        front.store.unwait(self.key)

    def poll(self) -> None:
        self.timer = None
        front, key = self.front, self.key
        store = front.store
        now = now_ms()
        got = store.get(key, now)
        if got is None and not store.pending(key, now):
            got = store.get(key, now)  # the leader may have stored it between the two calls
            if got is None:
                front.send_alone(self.take())
                return
        if got is not None:
            requests = self.take()
            replay, body = front.decode(key, got[0], now - got[1])
            for request in requests:
                front.answer(request, key, replay, body, now)
            front.coalesced(len(requests))
            return
        if time.monotonic() >= self.deadline:
            front.send_alone(self.take())
            return
        self.delay = min(self.delay * 2, _POLL_MAX_S)
        self.timer = front.loop.call_later(self.delay, self.poll)


class CacheFront:
    """One worker's cache stage (see the module docstring)."""

    __slots__ = ("store", "loop", "counters", "hit_latency", "slot", "ttl_ms", "wait_ms",
                 "max_value", "by_model", "catch_all", "flights", "waits",
                 "pipeline", "tier", "held", "renewing", "replays")

    def __init__(self, settings: Settings, tables: Tables, store: Store,
                 loop: asyncio.AbstractEventLoop, counters: Any, histograms: Any, slot: int,
                 pipeline: Pipeline) -> None:
        self.store = store
        self.loop = loop
        self.counters = counters
        self.hit_latency = histograms[H.CACHE_HIT]
        self.slot = slot
        self.ttl_ms = settings.cache_ttl_s * 1000
        # Followers in other workers wait at most the longest request timeout for a leader that
        # keeps its marker alive (LEASE_MS, renewed) before they go on their own.
        self.wait_ms = max(u.request_timeout_ms for u in tables.upstreams)
        self.max_value = store.max_value
        self.by_model = {r.model: settings.cache or r.cache for r in tables.routes
                         if r.model != CATCH_ALL}
        self.catch_all = any((settings.cache or r.cache) for r in tables.routes
                             if r.model == CATCH_ALL)
        self.flights: dict[bytes, Flight] = {}
        self.waits: dict[bytes, RemoteWait] = {}
        self.held: dict[bytes, Flight] = {}  # flights holding the store's marker (renewed)
        self.replays: dict[bytes, Replay] = {}  # large answers being written (Replay)
        self.renewing: asyncio.TimerHandle | None = None
        self.pipeline = pipeline  # continues the requests this stage held (from "limit")
        # VELOX_REDIS_URL: the shared tier behind the local store (velox.cache.redis).
        self.tier: RedisTier | None = None

    def attach_redis(self, tier: RedisTier) -> None:
        self.tier = tier

    def cached(self, model: str) -> bool:
        flag = self.by_model.get(model)
        return self.catch_all if flag is None else flag

    # --- before the limiter ------------------------------------------------------------------

    def front(self, batch: list[Request]) -> list[Request]:
        """Answer the hits, attach the followers; return the requests that go on."""
        out: list[Request] = []
        now = 0
        counters, slot = self.counters, self.slot
        for request in batch:
            model = request.model
            if request.kind is not Kind.MODEL_CALL or model is None or not self.cached(model):
                out.append(request)
                continue
            intent = self.intent(request)
            request.cache = intent
            if intent is _BYPASS:
                counters.add(slot, F.CACHE_BYPASSES, 1)
                out.append(request)
                continue
            key = intent.key
            if not now:
                now = now_ms()
            if intent.follow:  # neither no-cache nor no-store
                got = self.lookup(key, now, intent.max_age_ms)
                if got is not None:
                    counters.add(slot, F.CACHE_HITS, 1)
                    self.answer(request, key, got[0], got[1], now)
                    continue
                flight = self.flights.get(key)
                if flight is not None and flight.joinable:
                    flight.join(request)
                    continue
                if not request.stream and self._wait_remote(request, key, now):
                    continue
                tier = self.tier
                if tier is not None and tier.ask(self, request, key):
                    continue  # asks the Redis tier (velox.cache.redis); answered or goes on
            out.append(request)
        return out

    def intent(self, request: Request) -> Intent:
        bare = request.path.split(b"?", 1)[0]
        if bare not in CACHEABLE_PATHS:
            return _BYPASS
        no_cache, no_store, max_age_ms = cache_control(request.headers)
        if no_store:
            return _BYPASS
        canonical = canonical_body(request.body)
        if canonical is None:
            return _BYPASS
        key = cache_key(request.path, request.model or "", caller_of(request), request.stream,
                        canonical)
        return Intent(key, not no_cache, True, max_age_ms)

    def _wait_remote(self, request: Request, key: bytes, now: int) -> bool:
        wait = self.waits.get(key)
        if wait is None:
            store = self.store
            if not store.pending(key, now):
                return False
            if store.claim(key, now, LEASE_MS):
                store.release(key)  # the leader finished meanwhile: this one will lead
                return False
            wait = RemoteWait(self, key, time.monotonic() + self.wait_ms / 1000)
            self.waits[key] = wait
        wait.join(request)
        return True

    def lookup(self, key: bytes, now: int, max_age_ms: int) -> tuple[Replay, memoryview] | None:
        """A fresh stored answer for key: the copy this worker is still writing to other
        clients (a Replay), else the store's (None: none fresh enough)."""
        replay = self.replays.get(key)
        if replay is not None and replay.fresh(now, self.ttl_ms, max_age_ms):
            body = replay.body(False)
            if body is not None:
                return replay, body
        got = self.store.get(key, now, max_age_ms)
        if got is None:
            return None
        return self.decode(key, got[0], now - got[1])

    def decode(self, key: bytes, value: bytes, born_ms: int) -> tuple[Replay, memoryview]:
        """A stored value ready to be written; a large one is remembered while it is."""
        sse, headers, body = decode_entry(value)
        replay = Replay(sse, headers, born_ms)
        if len(body) > WHOLE_BYTES:
            self._share(key, replay, False, body)
        return replay, body

    def _share(self, key: bytes, replay: Replay, bare: bool, body: memoryview) -> None:
        replays = self.replays

        def written(ref: weakref.ref[memoryview]) -> None:  # no client holds this body now
            bodies = replay.bodies
            if bodies.get(bare) is ref:
                del bodies[bare]
            if not bodies and replays.get(key) is replay:
                del replays[key]

        replay.bodies[bare] = weakref.ref(body, written)
        replays[key] = replay

    def answer(self, request: Request, key: bytes, replay: Replay, body: memoryview,
               now: int) -> None:
        """Write a stored answer (a hit, or one a request in another worker fetched)."""
        _free(request)
        headers = [*replay.headers, (HEADER, HIT), (b"age", _age(now - replay.born_ms))]
        conn = request.conn
        if replay.sse:
            if usage_filter(request) is not None:
                bare = replay.body(True)
                if bare is None:
                    bare = memoryview(_without_usage(body))
                    if replay.bodies:
                        self._share(key, replay, True, bare)
                body = bare
            conn.start_stream(request, 200, headers)
            conn.send_chunk(body)  # type: ignore[arg-type]  # every event in one chunk
            conn.end_stream()
        else:
            conn.respond(request, 200, headers, body)
        self.hit_latency.record(self.slot, (time.perf_counter_ns() - request.t_received) // 1000)

    # --- after the limiter -------------------------------------------------------------------

    def follows(self, request: Request) -> bool:
        """An admitted miss: True when an identical request is fetching the answer (one
        admitted before it in this batch, or one another worker started meanwhile), which it
        now waits for instead of being sent. Otherwise it leads: it takes the store's
        in-flight marker here, atomically, so two workers never both lead one key."""
        intent = request.cache
        if intent is None or not intent.follow:  # None: the worker asks only with an intent
            return False
        key = intent.key
        flight = self.flights.get(key)
        if flight is not None:
            if not flight.joinable:
                return False
            flight.join(request)
            return True
        if request.stream:  # streams are not followed across workers
            return False
        wait = self.waits.get(key)
        if wait is None:
            now = now_ms()
            if self.store.claim(key, now, LEASE_MS):
                intent.marker = True
                return False
            wait = RemoteWait(self, key, time.monotonic() + self.wait_ms / 1000)
            self.waits[key] = wait
        wait.join(request)
        return True

    def observe(self, exchange: Exchange) -> None:
        """Give the exchange of a request with an intent its observer."""
        intent = exchange.request.cache
        assert intent is not None  # the worker asks only for a request with an intent
        if intent is _BYPASS:
            exchange.observer = _TAG
            return
        self.counters.add(self.slot, F.CACHE_MISSES, 1)
        flight = Flight(self, exchange, intent)
        exchange.observer = flight
        key = intent.key
        if intent.follow and key not in self.flights:
            flight.registered = True
            self.flights[key] = flight
        if intent.marker:
            intent.marker = False
            flight.marker = True
            self.held[key] = flight
            if self.renewing is None:
                self.renewing = self.loop.call_later(RENEW_S, self._renew)

    def _renew(self) -> None:
        """Every RENEW_S while this worker leads across workers: extend each marker's lease. A
        marker lost meanwhile (its lease lapsed and another worker took the key over) is
        forgotten: that flight leads no one outside this worker any more."""
        self.renewing = None
        held = self.held
        if not held:
            return
        store, now = self.store, now_ms()
        for key in [k for k in held if not store.renew(k, now, LEASE_MS)]:
            held.pop(key).marker = False
        if held:
            self.renewing = self.loop.call_later(RENEW_S, self._renew)

    def unhold(self, key: bytes) -> None:
        """A leader's call ended: drop its marker (only its own: the store checks)."""
        self.held.pop(key, None)
        self.store.release(key)

    # --- helpers -----------------------------------------------------------------------------

    def put(self, key: bytes, value: bytes) -> None:
        if self.store.put(key, value, now_ms(), self.ttl_ms):
            self.counters.add(self.slot, F.CACHE_STORES, 1)
            if self.tier is not None:
                self.tier.store(key, value)

    def _live(self, requests: list[Request]) -> list[Request]:
        """Held requests about to go on: detached from what held them; those whose client
        left meanwhile are dropped here (ingress finished them)."""
        for request in requests:
            request.exchange = None
        return [r for r in requests if not r.conn.closed]

    def go_on(self, requests: list[Request]) -> None:
        """Requests the Redis tier held that it could not answer: on to the miss path (the
        limiter, leading or following, dispatch), minus those whose client left."""
        live = self._live(requests)
        if live:
            self.pipeline.run(live, "limit")

    def coalesced(self, n: int) -> None:
        self.counters.add(self.slot, F.CACHE_COALESCED, n)

    def send_alone(self, requests: list[Request]) -> None:
        """Followers whose leader failed: each is sent upstream on its own (it may still be
        stored, but leads no one)."""
        live = self._live(requests)
        for request in live:
            intent = request.cache
            assert intent is not None  # every follower has one
            alone = Intent(intent.key, False, intent.store)
            alone.alone = True
            request.cache = alone
        if live:
            self.counters.add(self.slot, F.CACHE_ALONE, len(live))
            self.pipeline.run(live, "limit")

    def state(self) -> dict[str, int]:
        """For the worker's control-channel state: what this worker holds."""
        lookups = self.tier.lookups if self.tier is not None else {}
        return {"flights": len(self.flights),
                "followers": sum(len(f.followers) for f in self.flights.values()),
                "remote_waits": sum(len(w.requests) for w in self.waits.values()),
                "redis_lookups": len(lookups),
                "redis_waits": sum(len(lk.requests) for lk in lookups.values())}
