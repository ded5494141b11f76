"""Shared per-upstream health: circuit breakers, in-flight gauges, rpm buckets, retry budget.

One `SharedHealth` is created by the supervisor from `settings.tables` before it forks, like
the rate limiter's bucket, so every worker reads and writes the same state: the failures one
worker sees open the breaker for all of them, `max_in_flight` caps an upstream across the
whole gateway, and the retry budget is one budget. The algorithms are in C (native/vx_health.c):
each breaker is one atomic word changed by CAS, so a transition happens exactly once however
many processes race for it.

Breaker ([breaker] table): `failures` consecutive upstream-caused failures open it; an open
breaker gets no traffic for `open_s` seconds, doubled for each consecutive opening up to
`max_open_s`; then it is half-open and lets ONE probe request through at a time; `successes`
probe successes close it, a probe failure re-opens it (with the doubled time). A probe whose
answer never comes (its worker died) is presumed lost after the longest upstream request
timeout plus 1 s. Answers of requests admitted before an opening are ignored while it is open.
Which outcomes are failures is decided by `velox.routing.balance.verdict_of`.

Retry budget ([retry] table): a retry at second s is allowed only if, counting it,
    retries(last W s) <= budget_percent% x requests(last W s) + budget_min_per_s x W
where W = budget_window_s and both counts run over the W whole seconds ending at s (the current,
partial one included). One budget for the whole gateway, of the kind Finagle, tower's
retry::Budget and Linkerd use (a time window, a floor of retries per second, a share of the
requests); Envoy's retry budget is instead a share of the requests active at the moment.

Per-upstream rpm (`rpm` of an [[upstream]]): its own shared token bucket, burst = 10 s worth
(at least 1); a target whose bucket is empty is skipped, and a request no target can take
because of it gets 429 with the bucket's Retry-After. The buckets are entries of ONE native
`Limits` (`SharedHealth.rpm`, index = upstream, made before fork), so that with
VELOX_REDIS_URL the host's refresher can lease into them (velox.cluster.leases: each upstream's rpm
and tpm bucket is shared by every host as `upstream:<name>:rpm|tpm`); the check is one native
`take` per admission, as it was with a bucket of its own.

Per-upstream tpm (`tpm` of an [[upstream]]): `UpstreamTokens`, one shared token bucket per such
upstream (the native `Limits`, its own instance, indexed by upstream), rate tpm per minute and
burst one minute's worth (providers meter tokens per minute). The balancer takes the request's
estimated tokens from it after allow() (a target that cannot cover them is skipped like one
whose rpm bucket is empty); the relay's meter settles the reservation with the real usage when
the attempt's answer ends (`settle`: over-use is charged, leaving the bucket in debt until the
refill repays it; under-use is given back), and an attempt finished without an answer (failed,
retried elsewhere) gives its reservation back.

How the lead wires it (the API the worker and the egress pool use):

    health = SharedHealth.create(settings.tables)            # supervisor, before fork
    router = balance.Router(settings.tables, health)         # each worker, after fork
    plan = router.plan(model, affinity_key)                  # per request (velox.routing.balance)

`SharedHealth` implements `balance.LiveState` (all the balancer knows about it), plus
`snapshot()` for /stats and /metrics. Times are CLOCK_MONOTONIC milliseconds (`now_ms()`).
"""

from __future__ import annotations

from typing import Any

from velox import _native
from velox._native import Health, Limits, RetryBudget
from velox.config.tables import TableError, Tables
from velox.core.clock import now_ms

# Why an upstream cannot take a request now (allow() returns the negative).
REASON_OPEN = 1  # breaker open, or half-open with its probe slot taken
REASON_FULL = 2  # max_in_flight reached
REASON_RATE = 3  # the upstream's own rpm bucket is empty

SUCCESS = _native.OUTCOME_SUCCESS
FAILURE = _native.OUTCOME_FAILURE
NEUTRAL = _native.OUTCOME_NEUTRAL

# Breaker transitions (SharedHealth.transitions).
TR_OPENED = _native.TR_OPENED
TR_REOPENED = _native.TR_REOPENED
TR_HALF_OPENED = _native.TR_HALF_OPENED
TR_CLOSED = _native.TR_CLOSED

STATE_NAMES = {
    _native.BREAKER_CLOSED: "closed",
    _native.BREAKER_OPEN: "open",
    _native.BREAKER_HALF_OPEN: "half_open",
}
_UP_FIELDS = {
    "requests": _native.UP_REQUESTS,
    "successes": _native.UP_SUCCESSES,
    "failures": _native.UP_FAILURES,
    "retries": _native.UP_RETRIES,
    "panics": _native.UP_PANICS,
    "refused_full": _native.UP_FULL,
}
_UP_REQUESTS = _native.UP_REQUESTS
_UP_PANICS = _native.UP_PANICS
_UP_RETRIES = _native.UP_RETRIES
_UP_FULL = _native.UP_FULL
_CLOSED = _native.BREAKER_CLOSED
_PEEK_PROBE = _native.PEEK_PROBE
_PEEK_CLOSED = _native.PEEK_CLOSED


_MAX_S = 2**31 // 1000  # the native core keeps times in ms below 2^31


def check_tables(tables: Tables) -> None:
    """TableError naming the file, table and key of any value the shared state cannot hold."""
    b, r = tables.breaker, tables.retry
    limits: list[tuple[str, int, int, int]] = [
        ("[breaker] failures", b.failures, 1, 255),
        ("[breaker] successes", b.successes, 1, 255),
        ("[breaker] open_s", b.open_s, 1, _MAX_S),
        ("[breaker] max_open_s", b.max_open_s, b.open_s, _MAX_S),
        ("[retry] budget_percent", r.budget_percent, 0, 1000),
        ("[retry] budget_window_s", r.budget_window_s, 1, 3600),
        ("[retry] budget_min_per_s", r.budget_min_per_s, 0, 10**6),
    ]
    for u in tables.upstreams:
        limits.append((f"[[upstream]] {u.name!r} max_in_flight", u.max_in_flight, 0, 2**62))
        limits.append((f"[[upstream]] {u.name!r} rpm", u.rpm, 0, 10**9))
        limits.append((f"[[upstream]] {u.name!r} tpm", u.tpm, 0, 10**9))
    for key, value, lo, hi in limits:
        if not lo <= value <= hi:
            where = tables.source or "tables"
            raise TableError(f"{where}: {key} must be an integer in [{lo}, {hi}], got {value!r}",
                             f"fix {key} in {where}")


def rpm_burst(rpm: int) -> int:
    return max(1, rpm // 6)


class SharedHealth:
    """The live state of every upstream, shared by all workers (balance.LiveState).

    The per-request calls are bound native methods stored on the instance (no Python frame
    between the balancer and C): check, usable_mask, in_flight, allow, finish, record_request.
    """

    __slots__ = ("names", "index", "native", "budget", "rpm", "rpms", "take", "tpm",
                 "check", "usable_mask", "in_flight", "in_flight_sum", "allow", "finish",
                 "record_request")

    def __init__(self, names: tuple[str, ...], native: Health, budget: RetryBudget,
                 rpms: tuple[int, ...] = ()) -> None:
        self.names = names
        self.index = {name: i for i, name in enumerate(names)}
        self.native = native
        self.budget = budget
        # The upstreams' rpm buckets: entry u of one shared Limits (configured only for an
        # upstream with an rpm; burst rpm_burst(rpm)). rpms[u] == 0: no bucket.
        self.rpms = rpms or (0,) * len(names)
        self.rpm = Limits(max(1, len(names)))
        for u, rpm in enumerate(self.rpms):
            if rpm > 0:
                self.rpm.configure(u, rpm, rpm_burst(rpm))
        self.take = self.rpm.take  # (u, n) -> 0 taken, else µs until it could be (or -1)
        self.tpm: UpstreamTokens | None = None  # set by create() when an upstream has a tpm
        # (u, now) -> 0 | REASON_OPEN | REASON_FULL; takes nothing
        self.check = native.check
        # (tuple of u, now) -> bit k set when check(us[k], now) == 0
        self.usable_mask = native.usable_mask
        self.in_flight = native.in_flight
        self.in_flight_sum = native.in_flight_sum  # (tuple of u) -> their in_flight summed
        # (u, now) -> probe_slot >= 0, or -REASON_*: breaker passage, an in-flight place, an rpm
        # token. Native alone when no upstream has an rpm bucket.
        self.allow = self._allow_rated if any(self.rpms) else native.allow
        # (u, probe_slot, outcome, now): the one end of every admission; releases its place and
        # reports the outcome to the breaker.
        self.finish = native.finish
        self.record_request = budget.record_request  # (now) -> the second charged

    @classmethod
    def create(cls, tables: Tables) -> SharedHealth:
        """Map the shared state; must run in the supervisor, before the workers fork."""
        b = tables.breaker
        r = tables.retry
        ups = tables.upstreams
        check_tables(tables)
        lease_ms = min(max(u.request_timeout_ms for u in ups) + 1000, 2**31)
        native = Health(
            [u.max_in_flight for u in ups],
            failures=b.failures,
            successes=b.successes,
            open_ms=b.open_s * 1000,
            max_open_ms=b.max_open_s * 1000,
            probes=1,
            probe_lease_ms=lease_ms,
        )
        budget = RetryBudget(r.budget_percent, r.budget_window_s, r.budget_min_per_s)
        health = cls(tuple(u.name for u in ups), native, budget, tuple(u.rpm for u in ups))
        if any(u.tpm > 0 for u in ups):
            health.tpm = UpstreamTokens(tuple(u.tpm for u in ups))
        return health

    # --- balance.LiveState -----------------------------------------------------------------

    def _allow_rated(self, u: int, now: int) -> int:
        """allow() for tables with rpm buckets: the token is taken last, so a refusal by the
        breaker or the cap never spends one."""
        native = self.native
        probe_slot = native.enter(u, now)
        if probe_slot < 0:
            return -REASON_OPEN
        if not native.acquire(u):
            native.report(u, probe_slot, NEUTRAL, now)  # a probe slot back
            return -REASON_FULL
        if self.rpms[u] and self.take(u, 1):
            native.release(u)
            native.report(u, probe_slot, NEUTRAL, now)
            return -REASON_RATE
        native.count(u, _UP_REQUESTS)
        return probe_slot

    def allow_panic(self, u: int, now: int) -> int:
        """allow() ignoring the breaker (every target is open): probe_slot 0 or -REASON_*."""
        native = self.native
        if not native.acquire(u):
            return -REASON_FULL
        if self.rpms[u] and self.take(u, 1):
            native.release(u)
            return -REASON_RATE
        native.count(u, _UP_REQUESTS)
        native.count(u, _UP_PANICS)
        return 0

    def open_since(self, u: int, now: int) -> int:
        """When u's breaker last opened (ms); `now` if it never did."""
        opened = self.native.breaker(u, now)[5]
        return opened if opened >= 0 else now

    def retry_after_s(self, u: int) -> int:
        """Whole seconds until u's rpm bucket has a token again (at least 1)."""
        rate = self.rpm.config(u)[0]
        if not self.rpms[u] or rate <= 0:  # no bucket, or a leased one (the next lease fills it)
            return 1
        missing = 1 - self.rpm.level(u)  # whole tokens short of one (more when in debt)
        return max(1, -(-missing * 60 // rate))

    def try_retry(self, u: int, now: int) -> bool:
        """Take one retry from the gateway's budget for a retry on upstream u (counted)."""
        if not self.budget.try_retry(now):
            return False
        self.native.count(u, _UP_RETRIES)
        return True

    def is_closed(self, u: int, now: int) -> bool:
        """u's breaker is closed (whatever its in-flight count): what readiness asks. A busy
        upstream at its max_in_flight is not a broken one."""
        return self.native.peek(u, now) == _PEEK_CLOSED

    def count_full(self, u: int) -> None:
        """Count a request u refused at max_in_flight (found by check(), on the slow path)."""
        self.native.count(u, _UP_FULL)

    def transitions(self) -> tuple[list[tuple[int, int, int, int]], int]:
        """The breaker transitions this process made since the last call, and forgets them:
        ([(upstream, TR_*, at_ms, open_ms), ...], how many did not fit). Each transition is
        made by exactly one caller, in one process (one CAS): what every worker drains and
        logs is each transition once."""
        return self.native.transitions()

    def needs_probe(self, now: int | None = None) -> list[int]:
        """Upstreams whose breaker is not closed and would admit a probe now: what a background
        prober (every [breaker] probe_interval_s) sends its probe to, via allow() and finish(),
        so an idle upstream recovers without waiting for a user request to be its probe."""
        t = now_ms() if now is None else now
        peek = self.native.peek
        return [i for i in range(len(self.names)) if peek(i, t) == _PEEK_PROBE]

    # --- reporting ---------------------------------------------------------------------------

    def snapshot(self, now: int | None = None) -> dict[str, Any]:
        """Everything about every upstream, for /stats (plain JSON-able values)."""
        t = now_ms() if now is None else now
        native = self.native
        upstreams = {}
        for i, name in enumerate(self.names):
            state, count, probes, streak, _stamp, opened_at, opens, until = native.breaker(i, t)
            row: dict[str, Any] = {
                "state": STATE_NAMES[state],
                "consecutive_failures": count if state == _CLOSED else 0,
                "probe_successes": count if state != _CLOSED else 0,
                "probes_in_flight": probes,
                "consecutive_openings": streak,
                "opened_at_ms": opened_at,
                "open_count": opens,
                "until_half_open_ms": until,
                "in_flight": native.in_flight(i),
                "max_in_flight": native.max_in_flight(i),
            }
            for field, index in _UP_FIELDS.items():
                row[field] = native.counter(i, index)
            upstreams[name] = row
        requests, retries = self.budget.window(t)
        return {
            "upstreams": upstreams,
            "retry_budget": {
                "window_s": self.budget.window_s,
                "requests": requests,
                "retries": retries,
                "percent": self.budget.percent,
                "min_per_s": self.budget.min_per_s,
            },
        }


class UpstreamTokens:
    """The upstreams' tpm buckets (index = upstream; an upstream without tpm takes nothing).
    One native `Limits` mapping of their own, made before fork with the rest of the health."""

    __slots__ = ("limits", "burst")

    def __init__(self, tpms: tuple[int, ...]) -> None:
        self.limits = _native.Limits(len(tpms))
        self.burst = tpms  # one minute's worth; 0: no bucket
        for u, tpm in enumerate(tpms):
            if tpm > 0:
                self.limits.configure(u, tpm, tpm)

    def reserve(self, u: int, tokens: int) -> tuple[int, int]:
        """(tokens reserved, 0) when taken, else (0, µs until they could be). A request larger
        than a minute's worth reserves the minute (it could never be admitted otherwise)."""
        burst = self.burst[u]
        if not burst or tokens <= 0:
            return 0, 0
        n = min(tokens, burst)
        wait = self.limits.take(u, n)
        if wait == 0:
            return n, 0
        return 0, max(wait, 1)

    def give(self, u: int, tokens: int) -> None:
        if tokens > 0:
            self.limits.give(u, tokens)

    def settle(self, u: int, reserved: int, used: int) -> None:
        """The answer used `used` tokens against `reserved`: charge the excess (debt, repaid
        by the refill before the next reservation passes) or give the rest back."""
        if used > reserved:
            self.limits.charge(u, used - reserved)
        elif reserved > used:
            self.limits.give(u, reserved - used)

    def level(self, u: int) -> int:
        return int(self.limits.level(u)) if self.burst[u] else 0
