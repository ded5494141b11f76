"""Where a request goes: strategies, priorities, fallbacks, panic mode, retries.

Pure decisions over the frozen tables (velox.config.tables) and the live per-upstream state, which
is injected as a `LiveState` (velox.state.health.SharedHealth in the gateway, a plain object in
tests), so nothing here needs shared memory or sockets.

Per request, the worker does (the API the lead wires in):

    plan = router.plan(model, affinity_key)        # None: no route serves the model (404)
    attempt = plan.first()                         # a RouteAttempt, or a VeloxError to answer
    ... send to attempt.upstream (index) / attempt.target.upstream (name) as attempt.model ...
    on an answer or error:  verdict = verdict_of(event, status, retry_after_s, policy)
        nxt = plan.retry(attempt, verdict, committed=<bytes already sent to the client>)
        # retry() finishes `attempt` (releases its in-flight place, reports to its breaker)
        # and returns the next RouteAttempt (sleep attempt.delay_ms first), or None: answer with
        # what the failed attempt got (plan.stop_reason says why no retry).
    on success or a neutral end (client left):  plan.finish(attempt, verdict.outcome)

Every RouteAttempt is finished exactly once (finish() and retry() are no-ops on a finished one),
which releases everything it held; first() and retry() never block and never loop without
bound: each pass tries each target at most once.

Choosing within a route. Targets are grouped by `priority` (lower first); the next group is
used only when every target of the current one is unavailable (breaker open or probing,
max_in_flight reached, or its rpm bucket empty). Within a group:
- `weighted`: smooth weighted round-robin (nginx's: each pick adds every candidate's weight to
  its current value, takes the largest and subtracts the total from it), so weights 3:1 give
  A A B A, A A B A ... with no bursts. The state is per worker.
- `least_busy`: power of two choices on the shared in-flight gauge: two distinct candidates
  drawn with probability proportional to weight, the one with the fewer requests per unit
  of weight wins.
- `hash`: affinity. The caller extracts the key (x-velox-affinity header, else the body's
  prompt_cache_key, else its user) and passes bytes, or None for `weighted`. Keys are hashed
  with the native stable hash64 and placed by weighted rendezvous hashing (score = weight /
  -ln(u)), chosen over a ring with 150 virtual nodes per unit of weight by
  benches/bench_balance.py (results/balance.json): over 100,000 keys rendezvous is within 1% of
  perfect balance where the ring is 8-9% off, moves exactly the removed target's keys (and to an
  added target only its share), and its lookup is a single C call that is faster than the
  ring's bisect for 3 and 10 targets.
  Bounded load: a target whose in-flight count would pass ceil(1.25 x its weighted share of
  (all in-flight + 1)) hands the request to the next target in the key's order.

Retries (RetryPolicy): at most `attempts` tries in all; no new one once a failed one took longer
than `max_elapsed_ms`, once a byte went to the client, or when the gateway's retry budget says
no. The next target is chosen at the time of the retry (the state may have changed): untried
targets of the route first (priorities as above), then its `fallbacks` routes in order (only
those the caller's gateway key may use: a key's `models` hold for fallbacks too); a
tried target again only when no other can take it. A 429 retries its own target only when its
Retry-After is at most `same_target_retry_after_s` (after waiting it out). A retry to a target
already tried waits a short jittered backoff (min(1 s, 100 ms x 2^(n-1)) x [0.5, 1]).

Panic: when every target of the route and its fallbacks is refused by its breaker, the request
goes to the target whose breaker opened longest ago (counted as a panic on it; the one most
likely to have recovered) rather than failing. Envoy's panic threshold makes the same choice
(disregard health rather than fail everything, so failures cannot cascade) but at 50% healthy
and spreading over all hosts; here it applies only at 0% available, to one target, and a retry
never panics back into a target the request already tried. When every target is refused for
capacity: 503 overloaded if any was at max_in_flight, else 429 with Retry-After from the
soonest rpm bucket.

Tokens: a plan given the request's estimated tokens (`plan.tokens`) and a router given the
upstreams' tpm buckets (`tpm`, velox.state.health.UpstreamTokens) reserves the estimate on a
target's upstream before admitting it; a target whose bucket cannot cover it is refused like one
whose rpm bucket is empty (the next candidate is tried; Retry-After from the bucket when none can).
The attempt holds the reservation (`attempt.tokens`) until the relay's meter settles it with the
real usage; finish() gives back whatever is still held (an attempt that failed or was retried).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

from velox import _native
from velox.config.tables import RetryPolicy, RouteSpec, Tables, TargetSpec
from velox.core.clock import now_ms
from velox.core.errors import Overloaded, RateLimited, VeloxError
from velox.routing import twins
from velox.state.health import FAILURE, NEUTRAL, REASON_FULL, REASON_RATE, SUCCESS

BOUNDED_LOAD = 1.25  # a hash target may hold at most this times its share of the in-flight load
BACKOFF_MS = 100
BACKOFF_MAX_MS = 1000


class LiveState(Protocol):
    """What the balancer reads and takes; velox.state.health.SharedHealth is the real one.

    u is an upstream's index in tables.upstreams; times are monotonic milliseconds."""

    def check(self, u: int, now: int, /) -> int:
        """0 when a request could go now, else REASON_OPEN or REASON_FULL; takes nothing."""
        ...

    def usable_mask(self, us: tuple[int, ...], now: int, /) -> int:
        """Bit k set when check(us[k], now) == 0 (len(us) <= 64)."""
        ...

    def in_flight(self, u: int, /) -> int: ...

    def in_flight_sum(self, us: tuple[int, ...], /) -> int: ...

    def allow(self, u: int, now: int, /) -> int:
        """Take breaker passage, an in-flight place and an rpm token: a probe_slot >= 0, or
        -REASON_* having taken nothing."""
        ...

    def allow_panic(self, u: int, now: int, /) -> int:
        """allow() ignoring the breaker: probe_slot 0 or -REASON_FULL / -REASON_RATE."""
        ...

    def finish(self, u: int, probe_slot: int, outcome: int, now: int | None, /) -> None:
        """Release an admission and report its outcome (health.SUCCESS/FAILURE/NEUTRAL);
        now None: read the clock."""
        ...

    def open_since(self, u: int, now: int, /) -> int: ...

    def retry_after_s(self, u: int, /) -> int: ...

    def record_request(self, now: int, /) -> object: ...

    def try_retry(self, u: int, now: int, /) -> bool: ...

    def count_full(self, u: int, /) -> None:
        """Count a request u refused because it was at max_in_flight (found by check(),
        which takes nothing and so counts nothing; allow() counts its own refusals)."""
        ...


class TokenBuckets(Protocol):
    """The upstreams' tpm buckets (velox.state.health.UpstreamTokens)."""

    def reserve(self, u: int, tokens: int, /) -> tuple[int, int]:
        """(tokens reserved, 0), or (0, µs until they could be) having taken nothing."""
        ...

    def give(self, u: int, tokens: int, /) -> None: ...


# ---------------------------------------------------------------------------- verdict_of


class Event(IntEnum):
    """How an attempt ended. RESPONSE means response headers arrived: see the status."""

    RESPONSE = 0
    CONNECT_REFUSED = 1  # TCP connection refused
    CONNECT_RESET = 2  # connection reset or closed before any response byte
    TLS_ERROR = 3  # handshake or certificate failure
    CONNECT_TIMEOUT = 4
    REFUSED_STREAM = 5  # RST_STREAM(REFUSED_STREAM), or a stream above GOAWAY's last id
    HEADERS_TIMEOUT = 6  # no response headers within the request timeout
    BROKEN_AFTER_HEADERS = 7  # the stream or connection broke while the body was coming
    PROTOCOL_ERROR = 8  # the upstream sent something that is not valid HTTP
    CLIENT_GONE = 9  # our client disconnected
    GATEWAY_REFUSED = 10  # the gateway answered itself (its own 429 / 503)
    LOST_AFTER_HEADERS = 11  # the connection was lost after the headers, before the commit point


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: int  # for the breaker: health.SUCCESS, FAILURE or NEUTRAL
    retryable: bool  # may be sent again if nothing reached the client yet
    same_target: bool  # a retry may go to the same target (when no other can take it)
    retry_after_s: float | None = None  # a 429's Retry-After, waited out before a same-target retry


# Event -> (breaker outcome, retryable). Refused streams were never processed and say nothing
# bad about the upstream (a graceful GOAWAY, or its stream limit): retryable, not a failure.
# A stream the upstream broke after its headers, or a protocol error, says something about this
# request (it ran, and may break again wherever it goes): a failure, not retried. A connection
# lost while nothing had reached the client is retried whether or not the headers had come: an
# upstream that died or was cut off says nothing about the request. It may have run, so its
# tokens may be paid twice; the client still gets exactly one answer, and the alternative, a
# 502, is what the OpenAI and Anthropic SDKs retry by default (the same cost, later, seen).
EVENT_TABLE: dict[Event, tuple[int, bool]] = {
    Event.CONNECT_REFUSED: (FAILURE, True),
    Event.CONNECT_RESET: (FAILURE, True),
    Event.TLS_ERROR: (FAILURE, True),
    Event.CONNECT_TIMEOUT: (FAILURE, True),
    Event.REFUSED_STREAM: (NEUTRAL, True),
    Event.HEADERS_TIMEOUT: (FAILURE, True),
    Event.BROKEN_AFTER_HEADERS: (FAILURE, False),
    Event.LOST_AFTER_HEADERS: (FAILURE, True),
    Event.PROTOCOL_ERROR: (FAILURE, False),
    Event.CLIENT_GONE: (NEUTRAL, False),
    Event.GATEWAY_REFUSED: (NEUTRAL, False),
}
# Upstream statuses that are retried (502/503/504, and 529 "overloaded" as some providers
# send). Other 5xx count against the breaker but are not retried: the request may have run.
RETRYABLE_STATUSES = frozenset({502, 503, 504, 529})
_DEFAULT_POLICY = RetryPolicy()  # frozen: one instance serves every call


def verdict_of(event: Event, status: int = 0, retry_after_s: float | None = None,
             policy: RetryPolicy = _DEFAULT_POLICY) -> Verdict:
    """What an attempt's end means for the breaker and for a retry (before the commit point).

    Statuses: below 400, and client errors other than 429, show a working upstream (a
    success for its breaker; the request itself is not retried). 429 and 5xx are failures; 429,
    502, 503, 504 and 529 are retryable. A 429 may retry its own target only when it said
    Retry-After <= policy.same_target_retry_after_s."""
    if event != Event.RESPONSE:
        outcome, retryable = EVENT_TABLE[event]
        return Verdict(outcome, retryable, retryable)
    if status == 429:
        same = retry_after_s is not None and retry_after_s <= policy.same_target_retry_after_s
        return Verdict(FAILURE, True, same, retry_after_s if same else None)
    if status < 500:
        return Verdict(SUCCESS, False, False)
    retryable = status in RETRYABLE_STATUSES
    return Verdict(FAILURE, retryable, retryable)


# ------------------------------------------------------------------------------ hashing


# The hashing routes place keys with: the native hash64 and Rendezvous, or with VELOX_NATIVE=0
# their twins (`use`), which give the same numbers bit for bit (tests/native/test_hash_twins.py).
hash64: Callable[[bytes], int] = _native.hash64
Rendezvous: Callable[[list[int], list[float]], _native.Rendezvous | twins.Rendezvous] = \
    _native.Rendezvous


def use(native: bool) -> None:
    """Select the hashing: VELOX_NATIVE=0 the twins (velox.routing.twins: ~3 to 30 us a call
    where the C takes ~0.1). The worker calls this once, before its routes are built; a worker
    is a process of its own, so module globals are the cheapest switch."""
    global hash64, Rendezvous
    if native:
        hash64, Rendezvous = _native.hash64, _native.Rendezvous
    else:
        hash64, Rendezvous = twins.hash64, twins.Rendezvous


def target_seed(target: TargetSpec) -> int:
    """A target's identity in rendezvous hashing: its upstream and model."""
    return hash64(f"{target.upstream}\x00{target.model}".encode())


# ------------------------------------------------------------------------------ targets


class Target:
    """One target of one route, resolved to its upstream's index."""

    __slots__ = ("spec", "route", "u", "weight", "priority", "pos", "model", "index")

    def __init__(self, spec: TargetSpec, route: RouteSpec, u: int, pos: int,
                 index: int = -1) -> None:
        self.spec = spec
        self.route = route
        self.u = u
        # The name to send upstream: the target's own, else the route's public name; "" for a
        # target of the catch-all route without one (the client's name is sent).
        self.model = spec.model or (route.model if route.model != "*" else "")
        self.weight = spec.weight
        self.priority = spec.priority
        self.pos = pos  # index within its tier
        # Position among every (route, target) of the tables (stats.targets' row); -1: none.
        self.index = index

    def __repr__(self) -> str:
        return f"Target({self.route.model!r} -> {self.spec.upstream!r}/{self.spec.model!r})"


class Tier:
    """The targets of one priority of one route, with the strategy state they share."""

    __slots__ = ("targets", "us", "all", "uniform", "weight_sum", "current", "hasher")

    def __init__(self, targets: list[Target]) -> None:
        if len(targets) > 64:
            raise ValueError(f"route {targets[0].route.model!r}: more than 64 targets of one "
                             "priority")
        self.targets = targets
        self.us = tuple(t.u for t in targets)  # for one usable_mask call per group
        self.all = (1 << len(targets)) - 1
        self.uniform = len({t.weight for t in targets}) == 1
        self.weight_sum = sum(t.weight for t in targets)
        self.current = [0] * len(targets)  # smooth WRR's current weights (per worker)
        self.hasher = Rendezvous([target_seed(t.spec) for t in targets],
                                 [float(t.weight) for t in targets])


class Picker:
    """The targets of one route by priority, and its strategy."""

    __slots__ = ("route", "tiers", "strategy", "targets")

    def __init__(self, route: RouteSpec, index: dict[str, int],
                 positions: dict[tuple[str, str, str], int] | None = None) -> None:
        if not route.targets:
            raise ValueError(f"route {route.model!r} has no targets")
        self.route = route
        self.strategy = route.strategy
        tiers = []
        for priority in sorted({t.priority for t in route.targets}):
            specs = [t for t in route.targets if t.priority == priority]
            for spec in specs:
                if spec.upstream not in index:
                    raise ValueError(f"route {route.model!r}: unknown upstream {spec.upstream!r}")
                if spec.weight < 1:
                    raise ValueError(f"route {route.model!r}: weight must be >= 1")
            tiers.append(Tier([Target(s, route, index[s.upstream], i,
                                     -1 if positions is None else
                                     positions.get((route.model, s.upstream, s.model), -1))
                              for i, s in enumerate(specs)]))
        self.tiers = tuple(tiers)
        self.targets = tuple(t for tier in tiers for t in tier.targets)


def _weighted(tier: Tier, cands: list[Target]) -> Target:
    """nginx's smooth weighted round-robin over the candidates."""
    current = tier.current
    total = 0
    best = cands[0]
    best_c = -(1 << 62)
    for t in cands:
        c = current[t.pos] + t.weight
        current[t.pos] = c
        total += t.weight
        if c > best_c:
            best, best_c = t, c
    current[best.pos] = best_c - total
    return best


def _draw(cands: list[Target], total: int, rng: random.Random) -> Target:
    r = rng.random() * total
    for t in cands:
        r -= t.weight
        if r < 0:
            return t
    return cands[-1]


def _least_busy(state: LiveState, tier: Tier, cands: list[Target], rng: random.Random) -> Target:
    """Power of two choices, weight-aware: fewer in-flight requests per unit of weight wins."""
    n = len(cands)
    if n == 2:
        a, b = cands
    elif tier.uniform:
        i = int(rng.random() * n)
        j = int(rng.random() * (n - 1))
        a, b = cands[i], cands[j if j < i else j + 1]
    else:
        total = 0
        for t in cands:
            total += t.weight
        a = _draw(cands, total, rng)
        rest = [t for t in cands if t is not a]
        b = _draw(rest, total - a.weight, rng)
    in_flight = state.in_flight
    # (ia + 1) / wa <= (ib + 1) / wb, in integers; a tie goes to the first drawn
    if (in_flight(a.u) + 1) * b.weight <= (in_flight(b.u) + 1) * a.weight:
        return a
    return b


def _by_hash(state: LiveState, tier: Tier, cands: list[Target], key_hash: int) -> Target:
    """The key's first target in rendezvous order whose load stays within the bound."""
    in_flight = state.in_flight
    targets = tier.targets
    if cands is targets:  # every target is a candidate: one call for the total
        total = state.in_flight_sum(tier.us)
        weights = tier.weight_sum
        allowed = None
    else:
        total = 0
        weights = 0
        for t in cands:
            total += in_flight(t.u)
            weights += t.weight
        allowed = {t.pos for t in cands}
    first = None
    for pos in tier.hasher.rank(key_hash):
        if allowed is not None and pos not in allowed:
            continue  # tried, or unavailable
        t = targets[pos]
        if in_flight(t.u) + 1 <= math.ceil(BOUNDED_LOAD * (total + 1) * t.weight / weights):
            return t
        if first is None:
            first = t
    assert first is not None  # cands is not empty; some target is always within the bound
    return first


def _select(state: LiveState, strategy: str, tier: Tier, cands: list[Target],
            key_hash: int | None, rng: random.Random) -> Target:
    if len(cands) == 1:
        return cands[0]
    if strategy == "least_busy":
        return _least_busy(state, tier, cands, rng)
    if strategy == "hash" and key_hash is not None:
        return _by_hash(state, tier, cands, key_hash)
    return _weighted(tier, cands)


class Outcome:
    """Why a pass over the targets admitted nothing (for the refusal)."""

    __slots__ = ("open", "full", "rate")

    def __init__(self) -> None:
        self.open: list[Target] = []
        self.full: list[Target] = []
        self.rate: list[Target] = []


class Router:
    """The routes of the tables, ready to pick; one per worker (after fork)."""

    __slots__ = ("tables", "state", "chains", "catch_all", "rng", "retry_policy", "tpm",
                 "limited")

    def __init__(self, tables: Tables, state: LiveState, *, rng: random.Random | None = None,
                 tpm: TokenBuckets | None = None) -> None:
        self.tables = tables
        self.state = state
        self.tpm = tpm  # the upstreams' tpm buckets; None when no upstream has one
        self.rng = rng or random.Random()
        self.retry_policy = tables.retry
        index = {u.name: i for i, u in enumerate(tables.upstreams)}
        # Every (route, target) pair in tables order: the rows of stats.targets.
        positions = {(r.model, t.upstream, t.model): i for i, (r, t) in enumerate(
            (r, t) for r in tables.routes for t in r.targets)}
        pickers = {r.model: Picker(r, index, positions) for r in tables.routes}
        chains: dict[str, tuple[Picker, ...]] = {}
        for route in tables.routes:
            chain = [pickers[route.model]]
            for name in route.fallbacks:
                if name not in pickers:
                    raise ValueError(f"route {route.model!r}: fallback {name!r} is not a route")
                if pickers[name] not in chain:
                    chain.append(pickers[name])
            chains[route.model] = tuple(chain)
        self.chains = chains
        self.catch_all = chains.get("*")
        # (route, a key's allow-list) -> that route's chain without the routes it may not use
        self.limited: dict[tuple[str, frozenset[str]], tuple[Picker, ...]] = {}

    def plan(self, model: str, key: bytes | None = None,
             allowed: frozenset[str] | None = None) -> RoutePlan | None:
        """The attempt plan of one request for `model`; None when no route serves it.
        `allowed`: the routes the caller's key may use (None: any); fallbacks to others are
        left out of its plan (its own route was checked before it got here)."""
        chain = self.chains.get(model, self.catch_all)
        if chain is None:
            return None
        if allowed is not None and len(chain) > 1:
            chain = self._within(chain, allowed)
            if not chain:
                return None
        return RoutePlan(self, chain, model, None if key is None else hash64(key))

    def _within(self, chain: tuple[Picker, ...], allowed: frozenset[str]
                ) -> tuple[Picker, ...]:
        """chain without the routes outside `allowed`, made once per (chain, allow-list)."""
        limited = self.limited.get((chain[0].route.model, allowed))
        if limited is None:
            limited = tuple(p for p in chain if p.route.model in allowed)
            if len(self.limited) >= 4096:  # at most one per key and route; bounded anyway
                self.limited.clear()
            self.limited[(chain[0].route.model, allowed)] = limited
        return limited


class RouteAttempt:
    """One try: which route and target, and what it holds until it is finished."""

    __slots__ = ("route", "target", "upstream", "model", "probe_slot", "number", "panic",
                 "delay_ms", "started_ms", "finished", "tokens", "index")

    def __init__(self, target: Target, model: str, probe_slot: int, number: int, panic: bool,
                 delay_ms: int, now: int) -> None:
        self.route = target.route
        self.target = target.spec
        self.upstream = target.u  # index in tables.upstreams (the target's name is target.upstream)
        self.model = target.model or model  # the name to send upstream
        self.probe_slot = probe_slot
        self.number = number  # 1 for the first attempt
        self.panic = panic
        self.delay_ms = delay_ms  # wait this long before sending (a same-target retry)
        self.started_ms = now
        self.finished = False
        self.tokens = 0  # reserved on the upstream's tpm bucket (settled or given back)
        self.index = target.index  # the target's row in stats.targets (-1: none)

    def __repr__(self) -> str:
        return (f"RouteAttempt(#{self.number} {self.route.model!r} -> {self.target.upstream!r}"
                f"{' panic' if self.panic else ''})")


class RoutePlan:
    """Routing's state of one request: its attempts, each chosen when it is needed, the one
    open now, and how the last one went. The relay's exchange holds it (`Exchange.routing`);
    only dispatch (velox.routing.dispatch) writes the per-request part, which is also what
    the access log and the spend read of the answer's route."""

    __slots__ = ("router", "chain", "model", "key_hash", "tried", "hard", "count", "stop_reason",
                 "tokens", "held", "tpm_wait",
                 # dispatch's: the attempt open now (None once finished), the upstream and
                 # number of the last one sent, and its outcome for the breaker (NEUTRAL,
                 # SUCCESS, FAILURE: velox.state.health)
                 "attempt", "upstream_name", "attempts", "outcome")

    def __init__(self, router: Router, chain: tuple[Picker, ...], model: str,
                 key_hash: int | None) -> None:
        self.router = router
        self.chain = chain
        self.model = model
        self.key_hash = key_hash
        self.tried: list[Target] = []
        self.hard: list[Target] = []  # never again for this request (429 with a long wait)
        self.count = 0
        self.stop_reason = ""
        self.tokens = 0  # the request's estimated tokens (reserved on tpm upstreams)
        self.held = 0  # tokens the last admission reserved
        self.tpm_wait: dict[int, int] | None = None  # µs until each refusing tpm bucket could
        self.attempt: RouteAttempt | None = None
        self.upstream_name = b""
        self.attempts = 0
        self.outcome = 0  # NEUTRAL

    def _allower(self) -> Callable[[int, int], int]:
        router = self.router
        if self.tokens and router.tpm is not None:
            return self._allow_tokens
        return router.state.allow

    def _allow_tokens(self, u: int, now: int, panic: bool = False) -> int:
        """allow() that first reserves the estimate on u's tpm bucket (given back if the
        admission fails); -REASON_RATE when the bucket cannot cover it."""
        router = self.router
        tpm = router.tpm
        assert tpm is not None
        reserved, wait = tpm.reserve(u, self.tokens)
        if wait:
            if self.tpm_wait is None:
                self.tpm_wait = {}
            self.tpm_wait[u] = wait
            return -REASON_RATE
        state = router.state
        probe_slot = state.allow_panic(u, now) if panic else state.allow(u, now)
        if probe_slot < 0:
            tpm.give(u, reserved)
            return probe_slot
        self.held = reserved
        return probe_slot

    def first(self, now: int | None = None) -> RouteAttempt | VeloxError:
        """The first attempt, or the error to answer when no target can take the request."""
        t = now_ms() if now is None else now
        router = self.router
        state = router.state
        state.record_request(t)
        # Fast path: every target of the first group is usable and the chosen one admits.
        picker = self.chain[0]
        tier = picker.tiers[0]
        if state.usable_mask(tier.us, t) == tier.all:
            targets = tier.targets
            if len(targets) == 1:
                target = targets[0]  # (smooth WRR over one target leaves its state at 0)
            elif picker.strategy == "weighted":
                target = _weighted(tier, targets)
            else:
                target = _select(state, picker.strategy, tier, targets, self.key_hash,
                                 router.rng)
            probe_slot = state.allow(target.u, t) if not self.tokens or router.tpm is None \
                else self._allow_tokens(target.u, t)
            if probe_slot >= 0:
                self.tried.append(target)
                self.count = 1
                attempt = RouteAttempt(target, self.model, probe_slot, 1, False, 0, t)
                attempt.tokens, self.held = self.held, 0
                return attempt
            got = self._choose(t)  # the tier's weights moved once more: harmless
        else:
            got = self._choose(t)
        if isinstance(got, RouteAttempt):
            return got
        return self._refusal(got)

    def finish(self, attempt: RouteAttempt, outcome: int, now: int | None = None) -> None:
        """End an attempt: release its in-flight place and report outcome to its breaker."""
        if attempt.finished:
            return
        attempt.finished = True
        if attempt.tokens:  # not settled by an answer: the reservation goes back
            tpm = self.router.tpm
            assert tpm is not None
            tpm.give(attempt.upstream, attempt.tokens)
            attempt.tokens = 0
        self.router.state.finish(attempt.upstream, attempt.probe_slot, outcome, now)

    def retry(self, attempt: RouteAttempt, verdict: Verdict, *, committed: bool = False,
              now: int | None = None) -> RouteAttempt | None:
        """Finish a failed attempt and choose the next one; None when there is none (the
        client gets what `attempt` got; stop_reason says why)."""
        t = now_ms() if now is None else now
        self.finish(attempt, verdict.outcome, t)
        policy = self.router.retry_policy
        if committed:
            self._stop("committed")
            return None
        if not verdict.retryable:
            self._stop("not_retryable")
            return None
        if self.count >= policy.attempts:
            self._stop("attempts")
            return None
        if t - attempt.started_ms > policy.max_elapsed_ms:
            self._stop("elapsed")
            return None
        failed = self._target_of(attempt)
        if failed is not None and not verdict.same_target and failed not in self.hard:
            self.hard.append(failed)
        got = self._choose(t, verdict.retry_after_s)
        if not isinstance(got, RouteAttempt):
            self._stop("no_target")
            return None
        if not self.router.state.try_retry(got.upstream, t):
            self.finish(got, NEUTRAL, t)
            self.count -= 1
            self._stop("budget")
            return None
        return got

    # --- internals -------------------------------------------------------------------------

    def _stop(self, reason: str) -> None:
        self.stop_reason = reason

    def _target_of(self, attempt: RouteAttempt) -> Target | None:
        for t in self.tried:
            if t.spec is attempt.target and t.route is attempt.route:
                return t
        return None

    def _choose(self, now: int, retry_after_s: float | None = None) -> RouteAttempt | Outcome:
        state = self.router.state
        # Untried targets first; tried ones (except the hard-excluded) when none is left.
        got = self._pass(now, skip_tried=True)
        if self.tried and not isinstance(got, tuple):
            got = self._pass(now, skip_tried=False)
        if isinstance(got, tuple):
            target, probe_slot = got
            return self._attempt(target, probe_slot, False, now, retry_after_s)
        outcome = got
        if outcome.open and not outcome.full and not outcome.rate:
            # Panic: every candidate is refused by its breaker. The one open longest first;
            # a retry never panics back into a target this request already tried.
            panic = [x for x in outcome.open if x not in self.tried]
            tokens = self.tokens and self.router.tpm is not None
            for target in sorted(panic, key=lambda x: state.open_since(x.u, now)):
                probe_slot = self._allow_tokens(target.u, now, True) if tokens else \
                    state.allow_panic(target.u, now)
                if probe_slot >= 0:
                    return self._attempt(target, probe_slot, True, now, retry_after_s)
                (outcome.full if probe_slot == -REASON_FULL else outcome.rate).append(target)
        return outcome

    def _attempt(self, target: Target, probe_slot: int, panic: bool, now: int,
                 retry_after_s: float | None) -> RouteAttempt:
        delay = 0
        if target in self.tried:
            if retry_after_s is not None:
                delay = int(retry_after_s * 1000)
            else:
                backoff = min(BACKOFF_MAX_MS, BACKOFF_MS << max(0, self.count - 1))
                delay = int(backoff * (0.5 + self.router.rng.random() / 2))
        else:
            self.tried.append(target)
        self.count += 1
        attempt = RouteAttempt(target, self.model, probe_slot, self.count, panic, delay, now)
        attempt.tokens, self.held = self.held, 0
        return attempt

    def _pass(self, now: int, skip_tried: bool) -> tuple[Target, int] | Outcome:
        """One walk over the route and its fallbacks, priorities in order; each target is
        admitted at most once."""
        state = self.router.state
        usable_mask = state.usable_mask
        allow = self._allower()
        hard = self.hard
        tried = self.tried if skip_tried else None
        refused: dict[Target, int] | None = None  # admissions refused in this pass
        for picker in self.chain:
            strategy = picker.strategy
            for tier in picker.tiers:
                mask = usable_mask(tier.us, now)
                if not mask:
                    continue
                if mask == tier.all and not hard and not tried:
                    cands = tier.targets  # the common case: no copy until one is refused
                    shared = True
                else:
                    cands = [t for t in tier.targets if mask >> t.pos & 1
                             and not (hard and t in hard) and not (tried and t in tried)]
                    shared = False
                while cands:
                    t = _select(state, strategy, tier, cands, self.key_hash, self.router.rng)
                    probe_slot = allow(t.u, now)
                    if probe_slot >= 0:
                        return t, probe_slot
                    # Lost a race for it, or its rpm bucket is empty: the next candidate.
                    if shared:
                        cands = list(cands)
                        shared = False
                    cands.remove(t)
                    if refused is None:
                        refused = {}
                    refused[t] = -probe_slot
        return self._outcome(now, tried, refused)

    def _outcome(self, now: int, tried: list[Target] | None,
                 refused: dict[Target, int] | None) -> Outcome:
        """Why nothing was admitted: each candidate target by its reason (the slow path)."""
        check = self.router.state.check
        hard = self.hard
        outcome = Outcome()
        lists = (outcome.full, outcome.open, outcome.full, outcome.rate)  # 0: lost a race
        for picker in self.chain:
            for t in picker.targets:
                if t in hard or (tried and t in tried):
                    continue
                reason = refused.get(t) if refused else None
                if reason is None:
                    reason = check(t.u, now)
                    if reason == REASON_FULL:
                        self.router.state.count_full(t.u)
                lists[reason].append(t)
        return outcome

    def _refusal(self, outcome: Outcome) -> VeloxError:
        state = self.router.state
        if outcome.full:
            self.stop_reason = "full"
            return Overloaded(
                f"Every upstream serving {self.model!r} is at its max_in_flight; retry shortly.",
                retry_after_s=1)
        self.stop_reason = "rate_limited"
        tpm_wait = self.tpm_wait or {}
        wait = min((-(-tpm_wait[t.u] // 1_000_000) if t.u in tpm_wait else
                    state.retry_after_s(t.u) for t in outcome.rate), default=1)
        wait = max(1, wait)
        what = "request or token rate limit" if tpm_wait else "request rate limit"
        return RateLimited(
            f"Every upstream serving {self.model!r} is at its {what}; "
            "retry after the indicated time.", retry_after_s=wait)
