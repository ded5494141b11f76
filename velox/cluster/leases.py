"""Several Velox hosts sharing one Redis (VELOX_REDIS_URL): every rate limit global, Redis off
the request path.

Without VELOX_REDIS_URL nothing here runs. With it, each limit (the gateway's
VELOX_RATE_LIMIT_RPM, and every other bucket registered with `Cluster.add`) has ONE token
bucket kept in Redis, and each host's workers take from a LEASED bucket in the host's shared
memory (`velox._native.Limits`, configured with rate 0: only `give` fills it). The workers never
talk to Redis for limits (only the response cache's Redis tier does, velox.cache.redis). One
refresher per host, in the supervisor process (a thread running its own
asyncio loop with one redis.asyncio connection, hiredis parsing), leases blocks of tokens from
the Redis buckets and deposits them into the local ones:

* Every `TICK_S` (0.05 s) it reads each bucket's level, its cumulative `taken` and `refused`
  (tokens of takes the local bucket refused) and the largest take asked since its last look,
  and keeps an estimate of the host's recent DEMAND (tokens asked per second, admitted or
  refused: the last tick's, or the previous estimate decayed with a half-life of 1 s,
  whichever is higher: it follows a surge at once and lets go in seconds). A refused request
  is demand: a host whose bucket cannot serve its requests asks for more instead of seeing
  nothing admitted and letting its estimate decay to 0. A bucket's TARGET is about a second's
  worth of that demand (`LEASE_S`), at least 1 token and at most the LEASE CAP:
  ceil(rate per second x LEASE_S / hosts alive), at most the bucket's burst; plus, for a
  bucket whose takes are larger than one token (a tpm reservation), the largest recent take
  (times the number of such takes refused at once, at most `NEED_TAKES`; decaying with a
  half-life of `NEED_HALF_LIFE_S`), so the next such requests find enough.
  When the level falls to that extra plus half the rest, the refresher asks for what brings
  it back to the target: the next lease is asked for before the current one runs out, and at
  once when the bucket cannot serve its next take. A Redis bucket short of tokens grants what
  it has and says how long until the rest refills; the host does not ask again for that
  bucket before then (at most `LEASE_S`), which keeps an overloaded bucket to a few commands
  per host per second.
* All leases of one tick, and the host's registration, go to Redis as ONE script call per 500
  buckets, pipelined: a few commands per host per second whatever the request rate.
* The Lua script (`LEASE_LUA`) is atomic and reads Redis's own clock (TIME), so the hosts'
  clocks do not matter. A bucket is a hash {l: level, t: last refill µs}; absent means full
  (a new bucket, or one that expired after sitting full).
* Hosts register in a sorted set (score: Redis time of their last call); entries older than
  `HOST_TTL_S` are dropped, so every call also answers how many hosts are alive. A host that
  stops returns its unused tokens and leaves the set.

The bound. Tokens enter the Redis bucket only by its refill (rate) from a start at burst, and
a host admits only tokens it leased. So over ANY window of T seconds the hosts admit at most
    burst + rate x T + (tokens sitting in the hosts' local buckets when the window opened)
and the last term is at most hosts x lease cap = hosts x ceil(rate/60 x LEASE_S / hosts), about
one second of the limit (600 rpm on 3 hosts: 3 x 4 = 12 requests). Conversely, under a demand
above the limit, fewer are admitted only by the tokens leased but not used when the window
closes: at most one lease cap per host. `bound()` computes it. For a bucket whose takes are
larger than one token (a tpm reservation) each host may also hold the largest recent take on
top, up to NEED_TAKES of them when that many were refused at once: the bound is then
hosts x (lease cap + NEED_TAKES x the largest take), at most hosts x burst.

A bucket's first moments. Until its first lease arrives (one tick after `add`, a Redis round
trip) a bucket serves from the host's fallback share, as on an outage; what it took of it is
owed and paid out of its next leases (asked for even by an idle host). So a window that closes
after every host's debt is paid keeps the bound above; one that closes before may count up to
each host's fallback share more (burst / hosts each, about one burst in all).
A bucket added again after it had leases (a
reload, new limits) starts from leases only.

Low rates. Below one token per second per host the lease is one token: each host holds at most
one, asked for as soon as it used its last (the next tick), all of them batched into the same
call. A request that reaches a host whose token is spent gets 429 (Retry-After: 1) even if
another host's token sits unused: the limit is never exceeded, and what the hosts hold idle is
at most one token each (within the bound).

Redis unreachable (refused, reset, silent past `TIMEOUT_S`, or answering replies of another
shape than the script's, as a server that is not Redis would): the refresher logs once,
counts a fallback, and reconfigures every local bucket to a CLOCK-refilled bucket holding the
host's share: rate / hosts last seen, burst / hosts last seen (at least 1 each; 1 host if Redis
was never reached), keeping the tokens it had. It tries again every `RETRY_DOWN_S`; the first
call that succeeds switches every bucket back to leased (logged once). During an outage of T
seconds the hosts admit at most rate x T plus what they held (hosts x lease cap). A Redis that
lost its data (a restart without persistence) is noticed by the first host that had called it
before: the buckets it then makes start empty for a minute instead of full, so the outage does
not end with a second burst (see LEASE_LUA). No request waits on Redis for a limit: the
workers only ever touch shared memory for them.

Budgets (velox.spend.hosts) are leased on the same tick and connection (`Cluster.extras`),
by a scheme of their own: an allowance per host within what all hosts used and hold.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import socket
import threading
import time
from typing import Any, Protocol

from velox.config.settings import redact_url

log = logging.getLogger("velox.cluster")

TICK_S = 0.05  # refresher period: a spent lease is replaced within this
LEASE_S = 1.0  # a lease is about this long of the host's recent rate (and of its share)
HEARTBEAT_S = 1.0  # a host idle of leases still calls this often (registration)
HOST_TTL_S = 5.0  # a host not heard from this long is not counted (5 missed heartbeats)
# Connect and per-reply timeout; a whole call gets twice that. Past it Redis counts as
# unreachable. Only the refresher waits this long (the workers never wait on Redis); a loaded
# 2-core box has taken 0.3 s to answer a first connection.
TIMEOUT_S = 0.5
FIRST_LEASE = 3  # tokens at least in a bucket's first lease (at most its lease cap)
RETRY_DOWN_S = 0.5  # while Redis is unreachable, try again this often
RATE_HALF_LIFE_S = 1.0  # the host's rate estimate decays with this half-life
# The largest take kept in hand decays more slowly: a key sending one large request every few
# seconds still finds enough for it (what that holds is within `bound`'s `largest` term).
NEED_HALF_LIFE_S = 10.0
NEED_TAKES = 4  # at most this many of the largest take are kept in hand (requests at once)
CHUNK = 500  # buckets per script call (bounds the script's run time inside Redis)
KEY_PREFIX = "velox:"
HOSTS_KEY = KEY_PREFIX + "hosts"
ALIVE_KEY = KEY_PREFIX + "alive"  # exists while any host calls (PX 4 x HOST_TTL_S)
LOST_KEY = KEY_PREFIX + "lost"  # set for LOST_S when Redis is found to have lost its data
LOST_S = 60  # buckets made within this of a data loss start empty (a minute's worth of refill)
FIXED_KEYS = (HOSTS_KEY, ALIVE_KEY, LOST_KEY)

# KEYS[1..3]: FIXED_KEYS; KEYS[4..]: buckets. ARGV[1]: host id, ARGV[2]: host TTL (ms),
# ARGV[3]: "1" when the host leaves, ARGV[4]: "1" when the host has called this Redis before;
# then per bucket: rate per minute, burst, want (tokens to lease; negative: tokens returned).
# Returns {hosts alive, then per bucket: granted, wait_ms}.
#
# A bucket that does not exist starts full (a new limit, or one that expired after sitting
# full), except after a data loss: a host that called before and finds `alive` gone means
# Redis restarted empty (or every host was away for 20 s); buckets made in the next LOST_S then
# start empty, so a restart does not hand out a second burst.
LEASE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl_ms = tonumber(ARGV[2])
if ARGV[4] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('SET', KEYS[3], '1', 'PX', """ + str(LOST_S * 1000) + """)
end
redis.call('SET', KEYS[2], '1', 'PX', ttl_ms * 4)
local lost = redis.call('EXISTS', KEYS[3])
if ARGV[3] == '1' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  redis.call('ZADD', KEYS[1], now, ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl_ms * 1000)
redis.call('PEXPIRE', KEYS[1], ttl_ms * 4)
local out = {redis.call('ZCARD', KEYS[1])}
for i = 4, #KEYS do
  local a = 5 + (i - 4) * 3
  local rate = tonumber(ARGV[a])
  local burst = tonumber(ARGV[a + 1])
  local want = tonumber(ARGV[a + 2])
  local v = redis.call('HMGET', KEYS[i], 'l', 't')
  local level = tonumber(v[1])
  local ts = tonumber(v[2])
  if level == nil or ts == nil then
    level = burst
    if lost == 1 then level = 0 end
    ts = now
  end
  if now > ts then
    level = level + (now - ts) * rate / 60000000
  end
  if level > burst then
    level = burst
  end
  local grant = 0
  local wait = 0
  if want > 0 then
    grant = math.floor(level)
    if grant > want then grant = want end
    if grant < 0 then grant = 0 end
    level = level - grant
    if grant < want and rate > 0 then
      wait = math.ceil((want - grant - level) * 60000 / rate)
    end
  elseif want < 0 then
    level = math.min(burst, level - want)
  end
  redis.call('HSET', KEYS[i], 'l', string.format('%.17g', level), 't', string.format('%d', now))
  local full_ms = 60000
  if rate > 0 then full_ms = math.ceil((burst - level) * 60000 / rate) + 60000 end
  redis.call('PEXPIRE', KEYS[i], full_ms)
  out[#out + 1] = grant
  out[#out + 1] = wait
end
return out
"""


class ReplyShapeError(Exception):
    """A Redis reply that is not what its command answers (a proxy or a server that is not
    Redis, answering `+OK` to everything): treated like a lost connection, by the refresher
    and by the response cache's tier (velox.cache.redis)."""


class LimitsLike(Protocol):
    """What the refresher needs of velox._native.Limits (tests may pass a stand-in)."""

    def configure(self, i: int, rate_per_minute: int, burst: int) -> None: ...
    def take(self, i: int, n: int) -> int: ...
    def give(self, i: int, n: int) -> int: ...
    def level(self, i: int) -> int: ...
    def taken(self, i: int) -> int: ...
    def refused(self, i: int) -> int: ...
    def pop_largest(self, i: int) -> int: ...


def lease_cap(rate_per_minute: int, burst: int, hosts: int) -> int:
    """The most one host holds of a bucket: about a second of its share, at least 1."""
    share = rate_per_minute / 60 * LEASE_S / max(1, hosts)
    return max(1, min(burst, math.ceil(share)))


def bound(rate_per_minute: int, burst: int, hosts: int, largest: int = 1) -> int:
    """Tokens the hosts may hold unused at once: the most a window's count can be off by.
    `largest`: the largest single take (a tpm reservation); 1 for a request bucket."""
    extra = NEED_TAKES * largest if largest > 1 else 0
    return hosts * min(burst, lease_cap(rate_per_minute, burst, hosts) + extra)


def _need(largest: int, refused: int) -> float:
    """What a bucket should keep in hand for its large takes, from the largest take asked in
    the last tick and the tokens refused in it: takes refused beside the largest are
    requests wanting about that much at once (several SDK clients of one key), so keep that
    many (at most NEED_TAKES). 0 for a bucket of one-token takes (requests)."""
    if largest <= 1:
        return 0.0
    return float(largest * min(NEED_TAKES, 1 + refused // largest))


def lease_ask(rate_est: float, need: float, cap: int, burst: int, level: int) -> int:
    """Tokens to lease now for a local bucket holding `level`, asked at `rate_est` tokens per
    second recently, whose largest recent take was `need` (0: one token).

    The target is about a second of the demand (at least 1, at most the lease cap) plus
    `need`: enough for the next large take on top of the rate's lease. The lease is asked
    when the level is down to `need` plus half the rate's part, before it runs out, and
    above all when the bucket cannot serve its next take. 0: nothing to ask."""
    part = min(cap, max(1, math.ceil(rate_est * LEASE_S)))
    extra = math.ceil(need)
    target = min(burst, part + extra)
    if (level - extra) * 2 <= part and level < target:
        return target - level
    return 0


def fallback_share(rate_per_minute: int, burst: int, hosts: int) -> tuple[int, int]:
    """(rate, burst) of a host's own clock-refilled bucket while Redis is unreachable."""
    hosts = max(1, hosts)
    return max(1, rate_per_minute // hosts), max(1, burst // hosts)


class Leased:
    """One bucket: its Redis key, its local LEASED bucket and the host's view of its demand."""

    __slots__ = ("name", "key", "limits", "index", "rate", "burst", "cap", "rate_est",
                 "last_taken", "last_refused", "need", "next_ask", "want", "provisional", "first",
                 "start_taken", "owed")

    def __init__(self, name: str, limits: LimitsLike, index: int, rate: int, burst: int,
                 need: int = 0) -> None:
        self.name = name
        self.key = f"{KEY_PREFIX}bucket:{name}"
        self.limits = limits
        self.index = index
        self.rate = rate  # tokens per minute, global
        self.burst = burst  # global
        self.cap = 0  # the lease cap now (0: not configured yet)
        self.rate_est = 0.0  # tokens per second asked of this host (taken or refused), recently
        self.last_taken = limits.taken(index)
        self.last_refused = limits.refused(index)
        # The largest take recently asked, when larger than one token (a tpm reservation):
        # the local bucket keeps that much on top of the rate's lease, so the next such
        # request can pass. Decays with NEED_HALF_LIFE_S; starts at `need` (see add).
        self.need = float(min(burst, need)) if need > 1 else 0.0
        self.next_ask = 0.0  # monotonic time before which Redis is not asked (it was short)
        self.want = 0  # tokens asked for in the call in progress
        # Until its first lease arrives a bucket serves from the host's fallback share (a
        # clock bucket, as on an outage), so a key made at run time is not refused for the
        # length of a Redis round trip on every host; what it took meanwhile (`taken` counts
        # net of refunds) is `owed`, paid out of its next leases (see Cluster.add).
        self.provisional = False
        self.first = 0  # tokens at least in its first lease (Cluster._provisional)
        self.start_taken = 0
        self.owed = 0


class Cluster:
    """The host's refresher: one thread, one asyncio loop, one Redis connection."""

    def __init__(self, url: str, host_id: str | None = None) -> None:
        import redis.asyncio  # noqa: F401 - imported here, not inside the first call's timeout

        self.url = url
        self.host_id = host_id or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.buckets: list[Leased] = []
        self.hosts = 1  # hosts alive at the last successful call (1 before any)
        self.up = False
        self.started = False
        # Counters for /metrics (written by the refresher thread, read by the admin's).
        self.fallbacks = 0  # times Redis became unreachable
        self.lease_requests = 0  # bucket leases asked for
        self.commands = 0  # Redis commands sent
        self.leased_tokens = 0  # tokens granted by Redis
        self.errors = 0  # failed calls
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread: threading.Thread | None = None
        self._down_logged = False
        self._ever_up = False
        self._called = False  # a call of this host has succeeded (data-loss detection)
        self._sha = ""
        self._last_call = 0.0
        self._last_tick = 0.0
        # (name, Limits id, index) of buckets that have had a lease: one added again (a reload,
        # a run-time key's new limits) starts from leases only, as before.
        self._leased: set[tuple[str, int, int]] = set()
        # Other state leased the same way, on the same connection and tick (the budgets'
        # allowances, velox.spend.hosts): each has `async tick(client, cluster, now)`,
        # `down(hosts)` (Redis went away) and `async leave(client, cluster)`.
        self.extras: list[Any] = []

    # --- set-up (supervisor) -----------------------------------------------------------------

    def add(self, name: str, limits: LimitsLike, index: int, rate_per_minute: int,
            burst: int, need: int = 0) -> None:
        """Share the bucket `index` of `limits` with every host, as `name` in Redis.

        Call it before the workers that take from it fork. A bucket that never had a lease
        serves from the host's fallback share (full) until its first lease arrives, then
        holds only leased tokens and owes Redis what it took of the share (paid out of its
        next leases): a key made at run time, or a host just started, does not refuse its
        first requests for the length of a Redis round trip. One that had leases (a reload,
        new limits) is configured LEASED at once (empty; the next tick fills it); while Redis
        is unreachable, every bucket is on the host's share. `need`: the size of a typical
        take when larger than one token (a tpm bucket: a typical request's reservation), kept
        in hand from the first lease so the first such request passes. A bucket of the same
        name is replaced.
        """
        bucket = Leased(name, limits, index, rate_per_minute, burst, need)
        with self._lock:
            self.buckets = [b for b in self.buckets if b.name != name]
            self.buckets.append(bucket)
            if (self.up or not self._down_logged) and \
                    (name, id(limits), index) not in self._leased:
                self._provisional(bucket)
                return
            self._configure(bucket)
            if self.up or not self._down_logged:
                # Tokens the bucket had (a clock bucket starts full) came from no lease: drop
                # them, or every host would start with a whole burst of its own.
                level = limits.level(index)
                if level > 0:
                    limits.take(index, level)
                    limits.pop_largest(index)  # that take is no request's: no demand
                bucket.last_taken = limits.taken(index)

    def _provisional(self, b: Leased) -> None:
        """A bucket that never had a lease: the host's fallback share, full, until its first
        lease arrives (`_settle_provisional`)."""
        b.provisional = True
        b.first = FIRST_LEASE if self.up else 0  # hosts known: its cap is the right one
        b.cap = lease_cap(b.rate, b.burst, self.hosts)
        rate, burst = fallback_share(b.rate, b.burst, self.hosts)
        b.limits.configure(b.index, rate, burst)
        b.limits.give(b.index, burst)  # full, as a host alone would start
        b.start_taken = b.last_taken = b.limits.taken(b.index)

    def _settle_provisional(self, b: Leased) -> None:
        """The bucket's first lease arrived: from now on it holds only leased tokens. What is
        left of the share is dropped; what the workers took of it is owed to Redis."""
        limits, i = b.limits, b.index
        limits.configure(i, 0, b.burst)  # no more clock refill; the level is kept
        dropped = 0
        while (level := limits.level(i)) > 0:
            if limits.take(i, level) == 0:  # else a worker took meanwhile: read it again
                dropped = level
                limits.pop_largest(i)  # that take is no request's: no demand
                break
        b.owed += max(0, limits.taken(i) - b.start_taken - dropped)
        b.last_taken += dropped
        b.provisional = False
        self._leased.add((b.name, id(limits), i))

    def remove(self, prefix: str) -> None:
        """Stop sharing the buckets whose name starts with `prefix` (a reload's old keys)."""
        with self._lock:
            self.buckets = [b for b in self.buckets if not b.name.startswith(prefix)]

    def start(self, wait_s: float = 1.0) -> None:
        """Start the refresher and wait (at most wait_s) for its first call to end either way,
        so the workers fork with tokens in hand, or in fallback, not with empty buckets."""
        self._thread = threading.Thread(target=self._run, name="velox-redis", daemon=True)
        self._thread.start()
        self.started = True
        self._first.wait(wait_s)

    def stop(self, timeout_s: float = 1.0) -> None:
        """Return the unused tokens, leave the hosts' set, and end the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def metrics(self) -> dict[str, float]:
        return {"up": 1 if self.up else 0, "hosts": self.hosts, "fallbacks": self.fallbacks,
                "lease_requests": self.lease_requests, "commands": self.commands,
                "leased_tokens": self.leased_tokens, "errors": self.errors,
                "buckets": len(self.buckets)}

    # --- the refresher thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException:  # never take the supervisor down; the buckets keep their mode
            log.exception("the Redis refresher stopped")

    async def _main(self) -> None:
        client: Any = None
        next_try = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if client is None and now >= next_try:
                    client = self._connect()
                if client is not None:
                    try:
                        await asyncio.wait_for(self._tick(client, now), TIMEOUT_S * 2)
                    except Exception as exc:
                        self._went_down(exc)
                        await _close(client)
                        client = None
                        next_try = time.monotonic() + RETRY_DOWN_S
                self._first.set()
                await asyncio.sleep(max(0.0, TICK_S - (time.monotonic() - now)))
            if client is not None:
                try:
                    await asyncio.wait_for(self._leave(client), TIMEOUT_S * 2)
                except Exception:
                    pass
        finally:
            if client is not None:
                await _close(client)

    def _connect(self) -> Any:
        from redis.asyncio import Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        return Redis.from_url(
            self.url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S,
            single_connection_client=True, retry=Retry(NoBackoff(), 0), health_check_interval=0,
            decode_responses=False)

    def _plan(self, now: float) -> list[tuple[Leased, int]]:
        """Update each bucket's demand estimate; the leases to ask for now."""
        dt = now - self._last_tick if self._last_tick else TICK_S
        self._last_tick = now
        decay = 0.5 ** (dt / RATE_HALF_LIFE_S)
        need_decay = 0.5 ** (dt / NEED_HALF_LIFE_S)
        asks = []
        with self._lock:
            buckets = list(self.buckets)
        for b in buckets:
            limits, i = b.limits, b.index
            taken, refused = limits.taken(i), limits.refused(i)
            # Demand, not only admissions: a take the bucket refused counts too. Counting
            # only what was admitted, a bucket that cannot serve its next request admits
            # nothing, its estimate decays to 0 and it is never refilled (a locked-out key).
            asked = (taken - b.last_taken) + (refused - b.last_refused)
            b.rate_est = max(asked / dt if dt > 0 else 0.0, b.rate_est * decay)
            b.need = max(_need(limits.pop_largest(i), refused - b.last_refused),
                         b.need * need_decay)
            b.last_taken, b.last_refused = taken, refused
            if not self.up or now < b.next_ask:
                continue
            # A provisional bucket's share is no lease: ask as an empty bucket would; one
            # added while Redis is up (a new run-time key) for at least FIRST_LEASE tokens
            # (at most the lease cap, known then): it has seen no demand yet, and a one-token
            # first lease, going to repay the share, refused its next requests until another
            # tick. A debt is asked for on top, so an idle host pays it back too.
            rate_est = b.rate_est
            if b.provisional:
                level, rate_est = 0, max(rate_est, b.first / LEASE_S)
            else:
                level = limits.level(i)
            ask = lease_ask(rate_est, b.need, b.cap, b.burst, level) + b.owed
            if ask > 0:
                asks.append((b, ask))
        return asks

    async def _tick(self, client: Any, now: float) -> None:
        await self._lease_tick(client, now)
        if self.up:
            for extra in self.extras:
                await extra.tick(client, self, now)

    async def _lease_tick(self, client: Any, now: float) -> None:
        asks = self._plan(now)
        if not asks and self.up and now - self._last_call < HEARTBEAT_S:
            return
        if not self.up:
            asks = []  # registration first: how many hosts share the limits now
        replies = await self._call(client, asks, leave=False)
        self._last_call = now
        if not self.up:
            self._came_back()
            return
        for (b, want), (granted, wait_ms) in zip(asks, replies, strict=True):
            self.leased_tokens += granted
            if b.provisional:
                self._settle_provisional(b)
            short = granted < want
            paid = min(b.owed, granted)  # the share's tokens used before the first lease
            b.owed -= paid
            if granted > paid:
                b.limits.give(b.index, granted - paid)
            if short:
                b.next_ask = now + min(LEASE_S, max(TICK_S, wait_ms / 1000))
        self.lease_requests += len(asks)

    async def _leave(self, client: Any) -> None:
        """On stop: return every token still held (the workers are gone) and deregister."""
        with self._lock:
            buckets = list(self.buckets)
        returns = []
        for b in buckets:
            if b.provisional:  # its tokens are the host's share, not Redis's
                continue
            level = b.limits.level(b.index)
            if level > b.owed and self.up and b.limits.take(b.index, level) == 0:
                returns.append((b, b.owed - level))
        if self.up:
            for extra in self.extras:
                await extra.leave(client, self)
        await self._call(client, returns, leave=True)

    async def _call(self, client: Any, asks: list[tuple[Leased, int]],
                    leave: bool) -> list[tuple[int, int]]:
        """One script call per CHUNK buckets, pipelined; [(granted, wait_ms)] per ask."""
        from redis.exceptions import NoScriptError

        if not self._sha:
            self._sha = script_sha(await client.script_load(LEASE_LUA))
            self.commands += 1
        chunks = [asks[i:i + CHUNK] for i in range(0, len(asks), CHUNK)] or [[]]
        head = [self.host_id, int(HOST_TTL_S * 1000), "1" if leave else "0",
                "1" if self._called else "0"]
        for attempt in (0, 1):
            pipe = client.pipeline(transaction=False)
            for chunk in chunks:
                keys = [*FIXED_KEYS, *(b.key for b, _ in chunk)]
                args: list[Any] = list(head)
                for b, want in chunk:
                    args += [b.rate, b.burst, want]
                pipe.evalsha(self._sha, len(keys), *keys, *args)
            self.commands += len(chunks)
            try:
                results = await pipe.execute()
                break
            except NoScriptError:  # Redis restarted and lost its script cache: load it again
                if attempt:
                    raise
                self._sha = script_sha(await client.script_load(LEASE_LUA))
                self.commands += 1
        hosts, out = lease_replies(results, [[want for _, want in chunk] for chunk in chunks])
        self._called = True
        self._set_hosts(hosts)
        return out

    # --- modes --------------------------------------------------------------------------------

    def _configure(self, b: Leased) -> None:
        """Put one local bucket in the mode the host is in now (leased, or its share)."""
        if self.up or not self._down_logged:
            # The local capacity is the whole burst, so a take larger than a lease (a big tpm
            # reservation) can be met; what a host holds is set by the leases it asks for.
            b.cap = lease_cap(b.rate, b.burst, self.hosts)
            b.limits.configure(b.index, 0, b.burst)
        else:
            rate, burst = fallback_share(b.rate, b.burst, self.hosts)
            b.limits.configure(b.index, rate, burst)

    def _set_hosts(self, hosts: int) -> None:
        if hosts == self.hosts:
            return
        self.hosts = hosts
        with self._lock:  # a new lease cap for everyone
            for b in self.buckets:
                b.cap = lease_cap(b.rate, b.burst, hosts)

    def _went_down(self, exc: BaseException) -> None:
        self.errors += 1
        if self.up or not self._down_logged:
            self.fallbacks += 1
            self._down_logged = True
            self.up = False
            log.warning("Redis at %s is unreachable (%s); until it is back this host keeps to "
                        "its share of every limit (limit / %d host(s) last seen)",
                        redact_url(self.url), _describe(exc), self.hosts)
            with self._lock:
                for b in self.buckets:
                    # A provisional bucket is already on the share: it stays so, and like
                    # every bucket during an outage owes nothing for it.
                    b.provisional = False
                    b.owed = 0
                    self._configure(b)
                    if not self._ever_up:  # start full, as a host alone would
                        b.limits.give(b.index, fallback_share(b.rate, b.burst, self.hosts)[1])
            for extra in self.extras:
                extra.down(self.hosts)

    def _came_back(self) -> None:
        was_down = self._down_logged
        self.up = True
        self._ever_up = True
        self._down_logged = False
        with self._lock:
            for b in self.buckets:
                b.next_ask = 0.0
                if not b.provisional:  # a provisional one keeps its share until its lease
                    self._configure(b)
        if was_down:
            log.info("Redis at %s is reachable again; the limits are shared by %d host(s)",
                     redact_url(self.url), self.hosts)
        else:
            log.info("sharing %d limit(s) through Redis at %s with %d host(s)",
                     len(self.buckets), redact_url(self.url), self.hosts)


def lease_replies(results: Any, chunks: list[list[int]]) -> tuple[int, list[tuple[int, int]]]:
    """(hosts alive, [(granted, wait_ms)] per ask) from the script calls' replies, once each
    has LEASE_LUA's shape for its chunk of asks (`chunks`: the wants); else ReplyShapeError."""
    if not isinstance(results, list) or len(results) != len(chunks):
        raise ReplyShapeError(f"{len(results) if isinstance(results, list) else 'no'} replies "
                              f"to {len(chunks)} script call(s)")
    hosts, out = 1, []
    for result, wants in zip(results, chunks, strict=False):
        if not isinstance(result, list) or len(result) != 1 + 2 * len(wants) or \
                not all(type(v) is int for v in result) or result[0] < 1:
            raise ReplyShapeError("a lease script call answered something else than "
                                  f"{1 + 2 * len(wants)} integers")
        hosts = result[0]
        for k, want in enumerate(wants):
            granted, wait_ms = result[1 + 2 * k], result[2 + 2 * k]
            if not 0 <= granted <= max(0, want) or wait_ms < 0:
                raise ReplyShapeError(f"a lease of {want} answered {granted} granted")
            out.append((granted, wait_ms))
    return hosts, out


def script_sha(reply: Any) -> str:
    """SCRIPT LOAD's answer: the script's SHA-1 in hex; else ReplyShapeError."""
    sha = reply.decode("ascii", "replace") if isinstance(reply, bytes) else reply
    if not isinstance(sha, str) or len(sha) != 40 or \
            any(c not in "0123456789abcdef" for c in sha):
        raise ReplyShapeError("SCRIPT LOAD answered something else than a SHA-1")
    return sha


def _describe(exc: BaseException) -> str:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return f"no answer within {TIMEOUT_S * 2:g}s"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _close(client: Any) -> None:
    try:
        await client.aclose()
    except Exception:
        pass
