"""The response cache's Redis tier (VELOX_REDIS_URL with a cached route): hosts share answers.

The local shared-memory store (velox.cache.store) stays in front: a local hit never touches Redis.
A local miss of a request that may look up (neither no-cache nor no-store), with no identical
request already being fetched on this host, asks Redis before it goes on (`RedisTier.ask`);
the request waits asynchronously, like a cross-worker follower (`RedisLookup`, a
`velox.cache.wait.WaitList`), and is then either answered from Redis (`CacheFront.answer`:
`x-velox-cache: hit`, and the entry is copied into the local store) or continued on the normal
miss path (limiter, leader or follower, dispatch: `CacheFront.go_on`). It never waits longer than
VELOX_CACHE_REDIS_TIMEOUT_MS: past it the request goes on as a plain miss, and a late reply
only fills the local store.

Answers the local store keeps (`CacheFront.put`) are also written to Redis: `SET key value PX
ttl`, from a task (the answer is never delayed), at most `MAX_WRITES` waiting at once (more
are dropped and counted).

One connection per worker (redis.asyncio with hiredis, created lazily in the worker's loop) and
at most one call on it at a time: the lookups and writes gathered while a call is out go
together in the next one, one pipeline (the writes' SETs, then one MGET of every key asked).

Keys: `velox:cache:` + the hex of the 32-byte cache key (which covers the caller's identity,
velox.cache.store.cache_key). Values: the storing host's wall-clock time in ms (8 bytes, little
endian) and the entry as the local store holds it (velox.cache.store.encode_entry). Ages (the `age`
header, Cache-Control max-age) are computed from that time, so they are only as right as the
hosts' clocks agree (NTP: milliseconds); an entry from the future counts as age 0. A Redis
entry is served only while it is younger than this host's VELOX_CACHE_TTL_S too.

Redis down or slow: a failed call (refused, reset, past the socket timeout, or a reply not
of the shape its command gives: a proxy or a server that is not Redis) marks Redis down for
`RETRY_DOWN_S`, logged once per outage per worker; meanwhile requests skip Redis at once
(counted as errors) and writes are dropped; then the next lookup tries again. A call out for
longer than the lookup timeout also makes new lookups skip Redis until it returns.

Counters (velox.state.stats F): CACHE_REDIS_HITS (requests answered from Redis; also counted in
CACHE_HITS), CACHE_REDIS_MISSES (requests Redis had no usable entry for), CACHE_REDIS_ERRORS
(requests that went on without Redis's answer: failed, timed out or skipped while down),
CACHE_REDIS_STORES (answers written), CACHE_REDIS_DROPPED (answers not written).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from typing import TYPE_CHECKING, Any

from velox.cache.wait import Front, WaitList
from velox.cluster.leases import ReplyShapeError
from velox.config.settings import redact_url
from velox.core.clock import now_ms
from velox.core.fields import F

if TYPE_CHECKING:
    from velox.core.types import Request

log = logging.getLogger("velox.cache")

KEY_PREFIX = b"velox:cache:"
_CREATED = struct.Struct("<q")
RETRY_DOWN_S = 1.0  # after a failed call, Redis is skipped this long before it is tried again
SOCKET_TIMEOUT_S = 0.5  # a call past this (or the lookup timeout, if longer) fails and Redis
# counts as down; requests never wait longer than the lookup timeout either way
MAX_WRITES = 256  # answers waiting to be written; more are dropped (counted)


def redis_key(key: bytes) -> bytes:
    return KEY_PREFIX + key.hex().encode()


def encode_value(created_wall_ms: int, entry: bytes) -> bytes:
    return _CREATED.pack(created_wall_ms) + entry


def decode_value(value: bytes) -> tuple[int, bytes] | None:
    """(created wall-clock ms, entry), or None for a value that is not one of ours."""
    if len(value) < _CREATED.size + 5:
        return None
    return _CREATED.unpack_from(value)[0], value[_CREATED.size:]


def lookup_values(replies: Any, writes: int, asks: int) -> list[bytes | None]:
    """The MGET's values of one pipeline (`writes` SETs, then one MGET of `asks` keys when
    asks > 0), once every reply has the shape its command gives; else ReplyShapeError."""
    if not isinstance(replies, list) or len(replies) != writes + (1 if asks else 0):
        raise ReplyShapeError(f"{len(replies) if isinstance(replies, list) else 'no'} "
                              f"replies to {writes + (1 if asks else 0)} commands")
    for reply in replies[:writes]:
        if reply is not True and reply != b"OK":
            raise ReplyShapeError(f"SET answered {_shape(reply)}")
    if not asks:
        return []
    values = replies[-1]
    if not isinstance(values, list) or len(values) != asks or \
            not all(v is None or isinstance(v, bytes) for v in values):
        raise ReplyShapeError(f"MGET of {asks} key(s) answered {_shape(values)}")
    return values


def _shape(reply: Any) -> str:
    """What a reply was, without its content (it may hold a cached answer)."""
    if isinstance(reply, list):
        return f"a list of {len(reply)}"
    return type(reply).__name__


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class RedisLookup(WaitList[Front]):
    """Requests of this worker waiting for Redis's answer on one key. A client that leaves
    cancels nothing (the lookup is cheap and shared; its answer still fills the local store)."""

    __slots__ = ("tier", "open")

    def __init__(self, tier: RedisTier, front: Front, key: bytes) -> None:
        super().__init__(front, key)
        self.tier = tier
        self.open = True  # requests still wait on it (neither answered nor timed out)
        self.timer = tier.loop.call_later(tier.timeout_s, self.expire)

    def closed(self) -> None:
        self.open = False
        lookups = self.tier.lookups
        if lookups.get(self.key) is self:
            del lookups[self.key]

    def expire(self) -> None:
        """The timeout passed without Redis's answer: every request goes on as a miss."""
        self.timer = None
        if not self.open:
            return
        requests = self.take()
        tier = self.tier
        tier.counters.add(tier.slot, F.CACHE_REDIS_ERRORS, len(requests))
        self.front.go_on(requests)

    def resolve(self, value: bytes | None) -> None:
        """Redis answered (value None: no entry)."""
        front, tier = self.front, self.tier
        found = decode_value(value) if value else None
        entry, age_ms = b"", 0
        if found is not None:
            created, entry = found
            age_ms = max(0, wall_ms() - created)
            if age_ms < front.ttl_ms:
                # Into the local store, as old as it is: it expires when it would have here.
                mono = now_ms()
                front.store.put(self.key, entry, max(0, mono - age_ms),
                                front.ttl_ms - max(0, age_ms - mono))
            else:
                found = None
        if not self.open:
            return  # timed out: the requests went on; the entry only filled the local store
        requests = self.take()
        misses: list[Request] = []
        hits = 0
        now = now_ms()
        replay = body = None
        for request in requests:
            intent = request.cache
            assert intent is not None  # only misses with an intent ask the tier
            max_age = intent.max_age_ms
            if found is not None and (max_age < 0 or age_ms <= max_age):
                hits += 1
                if replay is None:
                    replay, body = front.decode(self.key, entry, now - age_ms)
                front.answer(request, self.key, replay, body, now)  # type: ignore[arg-type]
            else:
                misses.append(request)
        counters, slot = tier.counters, tier.slot
        if hits:
            counters.add(slot, F.CACHE_HITS, hits)
            counters.add(slot, F.CACHE_REDIS_HITS, hits)
        if misses:
            counters.add(slot, F.CACHE_REDIS_MISSES, len(misses))
            front.go_on(misses)

    def fail(self) -> None:
        if not self.open:
            return
        requests = self.take()
        tier = self.tier
        tier.counters.add(tier.slot, F.CACHE_REDIS_ERRORS, len(requests))
        self.front.go_on(requests)


class RedisTier:
    """One worker's connection to the shared tier (see the module docstring)."""

    __slots__ = ("url", "loop", "counters", "slot", "timeout_s", "ttl_ms", "client", "lookups",
                 "asking", "writes", "busy_since", "down_until", "down", "task")

    def __init__(self, url: str, timeout_ms: int, ttl_ms: int, loop: asyncio.AbstractEventLoop,
                 counters: Any, slot: int) -> None:
        self.url = url
        self.loop = loop
        self.counters = counters
        self.slot = slot
        self.timeout_s = timeout_ms / 1000
        self.ttl_ms = ttl_ms
        self.client: Any = None
        self.lookups: dict[bytes, RedisLookup] = {}  # open lookups by key
        self.asking: list[RedisLookup] = []  # not yet sent
        self.writes: list[tuple[bytes, bytes]] = []  # (redis key, value) not yet sent
        self.busy_since = 0.0  # monotonic start of the call out (0: none)
        self.down_until = 0.0
        self.down = False
        self.task: asyncio.Task[None] | None = None

    def available(self) -> bool:
        now = time.monotonic()
        if now < self.down_until:
            return False
        busy = self.busy_since
        return not busy or now - busy < self.timeout_s

    def ask(self, front: Front, request: Request, key: bytes) -> bool:
        """Hold the request until Redis answers for its key; False: it goes on at once."""
        lookup = self.lookups.get(key)
        if lookup is None:
            if not self.available():
                self.counters.add(self.slot, F.CACHE_REDIS_ERRORS, 1)
                return False
            lookup = RedisLookup(self, front, key)
            self.lookups[key] = lookup
            self.asking.append(lookup)
            self._kick()
        lookup.join(request)
        return True

    def store(self, key: bytes, entry: bytes) -> None:
        """Write an answer the local store took (fire and forget)."""
        if time.monotonic() < self.down_until or len(self.writes) >= MAX_WRITES:
            self.counters.add(self.slot, F.CACHE_REDIS_DROPPED, 1)
            return
        self.writes.append((redis_key(key), encode_value(wall_ms(), entry)))
        self._kick()

    def _kick(self) -> None:
        if self.task is None:
            self.task = self.loop.create_task(self._pump())

    def _connect(self) -> Any:
        from redis.asyncio import Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # A call may take as long as a lookup may wait: a shorter socket timeout would fail
        # (and mark Redis down) every call of a host whose Redis is slower than 0.5 s but
        # within its configured VELOX_CACHE_REDIS_TIMEOUT_MS.
        timeout = max(SOCKET_TIMEOUT_S, self.timeout_s)
        return Redis.from_url(
            self.url, socket_timeout=timeout, socket_connect_timeout=timeout,
            single_connection_client=True, retry=Retry(NoBackoff(), 0), health_check_interval=0,
            decode_responses=False)

    async def _pump(self) -> None:
        """One call at a time; what gathered meanwhile goes in the next (one pipeline)."""
        try:
            while self.asking or self.writes:
                asking = [lk for lk in self.asking if lk.open]
                writes = self.writes
                self.asking, self.writes = [], []
                if not asking and not writes:
                    break
                if self.client is None:
                    self.client = self._connect()
                pipe = self.client.pipeline(transaction=False)
                for name, value in writes:
                    pipe.set(name, value, px=self.ttl_ms)
                if asking:
                    pipe.mget([redis_key(lk.key) for lk in asking])
                self.busy_since = time.monotonic() or 1e-9
                try:
                    values = lookup_values(await pipe.execute(), len(writes), len(asking))
                except Exception as exc:
                    self.busy_since = 0.0
                    self._went_down(exc)
                    self.counters.add(self.slot, F.CACHE_REDIS_DROPPED, len(writes))
                    for lookup in asking:
                        lookup.fail()
                    for lookup in self.asking:
                        lookup.fail()
                    self.counters.add(self.slot, F.CACHE_REDIS_DROPPED, len(self.writes))
                    self.asking, self.writes = [], []
                    break
                self.busy_since = 0.0
                self._came_back()
                if writes:
                    self.counters.add(self.slot, F.CACHE_REDIS_STORES, len(writes))
                for lookup, got in zip(asking, values, strict=False):
                    lookup.resolve(got)
        finally:
            self.task = None
            self.busy_since = 0.0

    def _went_down(self, exc: BaseException) -> None:
        self.down_until = time.monotonic() + RETRY_DOWN_S
        client, self.client = self.client, None
        if client is not None:
            self.loop.create_task(_close(client))
        if not self.down:
            self.down = True
            why = f"{type(exc).__name__}: {exc}" if isinstance(exc, ReplyShapeError) \
                else type(exc).__name__
            log.warning("the cache's Redis at %s is unreachable (%s); cacheable requests go "
                        "on as local misses until it is back", redact_url(self.url), why)

    def _came_back(self) -> None:
        if self.down:
            self.down = False
            log.info("the cache's Redis at %s is reachable again", redact_url(self.url))

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await _close(client)


async def _close(client: Any) -> None:
    try:
        await client.aclose()
    except Exception:
        pass
