"""Pure-Python reference twins of the native shared state: counters, histograms, limits.

`Counters` and `Histogram` (native/vx_stats.c) live in shared memory so every worker adds to
one table; these twins hold the same numbers in plain lists of one process. They state what the
C does in a few lines each, and the differential tests (tests/native/test_stats_twins.py) drive
both with the same generated operations and compare every read. They are references, not
replacements: a per-process list cannot be shared by the workers, so VELOX_NATIVE=0 keeps the
native tables for these two.

`PyLimits` is the same for the shared token buckets and gauges (native/vx_limits.c: keys,
upstreams and the gateway's global rate): one process's integers, with the C's units, refill
clamps, debt floor and admit packing; tests/native/test_limits_twins.py compares them.
`PyHealth` restates the breakers (native/vx_health.c: the state word's fields, the doubling open
time, probe slots and their lease, stale probe slots), the in-flight gauges and the transitions a
process keeps; tests/native/test_health_twins.py compares them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

MAX_SLOTS = 4096  # slots and fields: at most this many (vx_stats.h: VX_STATS_MAX_SLOTS)
_INT64 = (-(1 << 63), (1 << 63) - 1)
_MAX_PAIRS = 16  # add_many takes 1 to 16 (field, n) pairs

# The histogram's buckets (vx_stats.h): one per value below EXACT, then 64 sub-buckets per
# power of two; values above MAX_US (10 min) count in MAX_US's bucket.
SUB_BITS = 6
SUB = 1 << SUB_BITS
EXACT = 2 * SUB
MAX_US = 600_000_000
BUCKETS = EXACT + (29 - 7) * SUB + 7 + 1


def _wrap(value: int) -> int:
    """int64 two's-complement wrap-around, as the C's atomic adds do."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def _check_int64(value: int) -> None:
    if not _INT64[0] <= value <= _INT64[1]:
        raise ValueError(f"{value} does not fit in int64")


class PyCounters:
    """slots x fields int64 counters (the native Counters' API without memfd)."""

    def __init__(self, slots: int, fields: int) -> None:
        if not (1 <= slots <= MAX_SLOTS and 1 <= fields <= MAX_SLOTS):
            raise ValueError(f"slots and fields must be in [1, {MAX_SLOTS}]")
        self.slots = slots
        self.fields = fields
        self._rows = [[0] * fields for _ in range(slots)]

    def _check(self, slot: int, field: int) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range")
        if not 0 <= field < self.fields:
            raise IndexError(f"field {field} out of range")

    def add(self, slot: int, field: int, n: int = 1, /) -> None:
        self._check(slot, field)
        _check_int64(n)
        row = self._rows[slot]
        row[field] = _wrap(row[field] + n)

    def add_many(self, slot: int, *field_n: int) -> None:
        """Every pair checked before anything is added, as the native call does."""
        if not field_n or len(field_n) % 2 or len(field_n) > 2 * _MAX_PAIRS:
            raise TypeError(f"add_many takes 1 to {_MAX_PAIRS} (field, n) pairs")
        pairs = list(zip(field_n[::2], field_n[1::2], strict=True))
        for field, n in pairs:
            self._check(slot, field)
            _check_int64(n)
        for field, n in pairs:
            self.add(slot, field, n)

    def set(self, slot: int, field: int, value: int, /) -> None:
        self._check(slot, field)
        _check_int64(value)
        self._rows[slot][field] = value

    def get(self, slot: int, field: int, /) -> int:
        self._check(slot, field)
        return self._rows[slot][field]

    def totals(self) -> list[int]:
        return [_wrap(sum(column)) for column in zip(*self._rows, strict=True)]

    def snapshot(self) -> list[list[int]]:
        return [list(row) for row in self._rows]


def bucket_index(value_us: int) -> int:
    """vx_hist_index: the bucket of a value (clamped to [0, MAX_US])."""
    value = min(max(value_us, 0), MAX_US)
    if value < EXACT:
        return value
    k = value.bit_length() - 1  # 7 .. 29
    return EXACT + (k - 7) * SUB + (value >> (k - SUB_BITS)) - SUB


def bucket_lower(index: int) -> int:
    if index < EXACT:
        return index
    group, sub = divmod(index - EXACT, SUB)
    return (SUB + sub) << (group + 1)


def bucket_upper(index: int) -> int:
    """Inclusive."""
    if index < EXACT:
        return index
    return bucket_lower(index) + (1 << ((index - EXACT) // SUB + 1)) - 1


def bucket_mid(index: int) -> int:
    low, high = bucket_lower(index), bucket_upper(index)
    return low + (high - low) // 2


class PyHistogram:
    """One log-linear latency histogram per slot (the native Histogram's API)."""

    def __init__(self, slots: int) -> None:
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in [1, {MAX_SLOTS}]")
        self.slots = slots
        self._counts = [[0] * BUCKETS for _ in range(slots)]
        self._sums = [0] * slots

    def _slot(self, slot: int) -> None:
        if not -1 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range")

    def record(self, slot: int, value_us: int, /) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range")
        if not _INT64[0] <= value_us <= _INT64[1]:
            raise ValueError(f"value_us {value_us} does not fit in int64")
        value = max(value_us, 0)
        self._counts[slot][bucket_index(value)] += 1
        self._sums[slot] = _wrap(self._sums[slot] + value)

    def _merged(self, slot: int) -> list[int]:
        self._slot(slot)
        rows = self._counts if slot < 0 else [self._counts[slot]]
        return [sum(column) for column in zip(*rows, strict=True)]

    def percentiles(self, qs: Sequence[float], slot: int = -1) -> list[int]:
        """Nearest rank: the midpoint of the first bucket holding ceil(q * count) values."""
        self._slot(slot)  # the slot is checked first, as the native call does
        for q in qs:
            if not 0 < q <= 1:
                raise ValueError(f"quantile must be in (0, 1], got {q!r}")
        counts = self._merged(slot)
        total = sum(counts)
        out = []
        for q in qs:
            if total <= 0:
                out.append(0)
                continue
            rank = max(1, math.ceil(q * total))  # in doubles, as the C computes it
            seen = 0
            for index, n in enumerate(counts):
                seen += n
                if seen >= rank:
                    out.append(bucket_mid(index))
                    break
        return out

    def count(self, slot: int = -1) -> int:
        return sum(self._merged(slot))

    def total_us(self, slot: int = -1) -> int:
        self._slot(slot)
        return _wrap(sum(self._sums) if slot < 0 else self._sums[slot])

    def buckets(self, slot: int = -1) -> list[tuple[int, int]]:
        return [(bucket_upper(i), n) for i, n in enumerate(self._merged(slot)) if n]


# --- Limits (native/vx_limits.c): token buckets and concurrency gauges ----------------------

UNITS_PER_TOKEN = 60_000_000  # vx_units.h: microseconds per minute, so rate r adds r units/us
MAX_ENTRIES = 1_000_000
MAX_RATE = MAX_BURST = 1_000_000_000
MAX_TOKENS = 10_000_000_000  # one give/refund/charge, and the deepest debt
LEASE_WAIT_US = PARALLEL_WAIT_US = 1_000_000
NEVER = -1
ADMIT_REQUESTS, ADMIT_TOKENS, ADMIT_PARALLEL = 1, 2, 3
_DEBT_FLOOR = -MAX_TOKENS * UNITS_PER_TOKEN


def _saturate(value: int) -> int:
    """to_i64: an integer past int64 saturates (the callers then clamp or refuse)."""
    return min(max(value, _INT64[0]), _INT64[1])


def _in_range(value: int, name: str, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _index(value: int, name: str, n: int) -> int:
    if not 0 <= value < n:
        raise IndexError(f"{name} {value!r} out of range [0, {n})")
    return value


def _tokens(value: int, lo: int) -> int:
    n = _saturate(value)
    if n < lo:
        raise ValueError(f"n must be >= {lo}, got {value!r}")
    return n


class _Entry:
    __slots__ = ("rate", "burst", "level", "last_us", "taken", "refused", "largest", "active",
                 "entered")

    def __init__(self) -> None:
        self.rate = self.burst = self.level = self.last_us = 0
        self.taken = self.refused = self.largest = self.active = self.entered = 0

    def refill(self, rate: int, cap: int, now_us: int) -> None:
        """Credit (last_us, now_us] at rate, at most up to cap; leased (rate 0): nothing."""
        if rate <= 0 or now_us <= self.last_us:
            return
        elapsed = min(now_us - self.last_us, (cap - _DEBT_FLOOR) // rate + 1)
        self.last_us = now_us
        self.add_capped(elapsed * rate, cap)

    def add_capped(self, add: int, cap: int) -> int:
        room = cap - self.level
        if room <= 0 or add <= 0:
            return 0
        added = min(add, room)
        self.level += added
        return added


class PyLimits:
    """The native Limits' API (without memfd and the test hammer), one process's numbers.
    `now_us` None reads CLOCK_MONOTONIC like the C; the differential tests pass it always."""

    def __init__(self, n: int, slots: int = 64) -> None:
        self.n = _in_range(n, "n", 1, MAX_ENTRIES)
        self.slots = _in_range(slots, "slots", 1, MAX_SLOTS)
        self._e = [_Entry() for _ in range(n)]
        self._held = [[0] * n for _ in range(slots)]

    def __len__(self) -> int:
        return self.n

    @staticmethod
    def _now(now_us: int | None) -> int:
        if now_us is None:
            return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return _in_range(now_us, "now_us", *_INT64)

    def configure(self, i: int, rate_per_minute: int, burst: int,
                  now_us: int | None = None, /) -> None:
        e = self._e[_index(i, "index", self.n)]
        rate = _in_range(rate_per_minute, "rate_per_minute", 0, MAX_RATE)
        burst = _in_range(burst, "burst", 1, MAX_BURST)
        now = self._now(now_us)
        cap = burst * UNITS_PER_TOKEN
        if e.burst == 0:  # first configuration: full, or empty when leased
            e.level = cap if rate > 0 else 0
            e.last_us = now
        else:
            e.refill(e.rate, e.burst * UNITS_PER_TOKEN, now)  # the old rate up to now
            e.last_us = max(e.last_us, now)  # leased time is not credited at the new rate
            e.level = min(e.level, cap)  # capped at the new burst; debt kept
        e.rate, e.burst = rate, burst

    def config(self, i: int, /) -> tuple[int, int]:
        e = self._e[_index(i, "index", self.n)]
        return e.rate, e.burst

    def take(self, i: int, n: int, now_us: int | None = None, /) -> int:
        e = self._e[_index(i, "index", self.n)]
        n = _tokens(n, 1)
        now = self._now(now_us)
        if n > e.burst:
            return NEVER
        need = n * UNITS_PER_TOKEN
        e.largest = max(e.largest, n)
        e.refill(e.rate, e.burst * UNITS_PER_TOKEN, now)
        if e.level >= need:
            e.level -= need
            e.taken += n
            return 0
        e.refused += n
        if e.rate == 0:
            return LEASE_WAIT_US
        return -(-(need - e.level) // e.rate)  # microseconds until need, rounded up

    def give(self, i: int, n: int, /) -> int:
        e = self._e[_index(i, "index", self.n)]
        n = min(_tokens(n, 0), MAX_TOKENS)
        if n < 1:
            return 0
        return e.add_capped(n * UNITS_PER_TOKEN, e.burst * UNITS_PER_TOKEN) // UNITS_PER_TOKEN

    def refund(self, i: int, n: int, /) -> int:
        e = self._e[_index(i, "index", self.n)]
        n = min(_tokens(n, 0), MAX_TOKENS)
        if n < 1:
            return 0
        added = self.give(i, n)
        e.taken -= n
        return added

    def charge(self, i: int, n: int, /) -> None:
        e = self._e[_index(i, "index", self.n)]
        n = min(_tokens(n, 0), MAX_TOKENS)
        if n < 1:
            return
        lowered = max(e.level - n * UNITS_PER_TOKEN, _DEBT_FLOOR)  # debt stops at the floor
        e.level = min(e.level, lowered)
        e.taken += n

    def level(self, i: int, now_us: int | None = None, /) -> int:
        e = self._e[_index(i, "index", self.n)]
        now = self._now(now_us)
        cap = e.burst * UNITS_PER_TOKEN
        cur = e.level
        if e.rate > 0 and cur < cap:
            pending = min(max(now - e.last_us, 0), (cap - cur) // e.rate + 1)
            cur = min(cur + pending * e.rate, cap)
        return cur // UNITS_PER_TOKEN

    def taken(self, i: int, /) -> int:
        return self._e[_index(i, "index", self.n)].taken

    def refused(self, i: int, /) -> int:
        return self._e[_index(i, "index", self.n)].refused

    def pop_largest(self, i: int, /) -> int:
        e = self._e[_index(i, "index", self.n)]
        largest, e.largest = e.largest, 0
        return largest

    def enter(self, i: int, limit: int, slot: int, /) -> bool:
        e = self._e[_index(i, "index", self.n)]
        _in_range(limit, "limit", *_INT64)
        row = self._held[_index(slot, "slot", self.slots)]
        if 0 < limit <= e.active:
            return False
        e.active += 1
        row[i] += 1
        e.entered += 1
        return True

    def leave(self, i: int, slot: int, /) -> bool:
        e = self._e[_index(i, "index", self.n)]
        row = self._held[_index(slot, "slot", self.slots)]
        if row[i] <= 0:
            return False
        row[i] -= 1
        e.active -= 1
        return True

    def active(self, i: int, /) -> int:
        return self._e[_index(i, "index", self.n)].active

    def held(self, i: int, slot: int, /) -> int:
        _index(i, "index", self.n)
        return self._held[_index(slot, "slot", self.slots)][i]

    def entered(self, i: int, /) -> int:
        return self._e[_index(i, "index", self.n)].entered

    def forget_slot(self, slot: int, /) -> int:
        row = self._held[_index(slot, "slot", self.slots)]
        total = 0
        for i, h in enumerate(row):
            if h > 0:
                self._e[i].active -= h
                total += h
            row[i] = 0
        return total

    def admit(self, req_i: int, tok_i: int, tokens: int, gauge_i: int, limit: int, slot: int,
              now_us: int | None = None, /) -> int:
        """All or nothing; admitted: ~(left_req | left_tok << 32); refused:
        wait_us * 4 + reason (wait 0 for never)."""
        for value, name in ((req_i, "req_i"), (tok_i, "tok_i")):
            if value != -1:
                _index(value, name, self.n)
        _in_range(tokens, "tokens", 0, MAX_TOKENS)
        if gauge_i != -1:
            _index(gauge_i, "gauge_i", self.n)
        _in_range(limit, "limit", *_INT64)
        _index(slot, "slot", self.slots)
        now = self._now(now_us)
        if req_i >= 0 and (wait := self.take(req_i, 1, now)) != 0:
            return max(wait, 0) * 4 + ADMIT_REQUESTS
        tokens_step = tok_i >= 0 and tokens > 0
        if tokens_step and (wait := self.take(tok_i, tokens, now)) != 0:
            if req_i >= 0:
                self.refund(req_i, 1)
            return max(wait, 0) * 4 + ADMIT_TOKENS
        if gauge_i >= 0 and not self.enter(gauge_i, limit, slot):
            if req_i >= 0:
                self.refund(req_i, 1)
            if tokens_step:
                self.refund(tok_i, tokens)
            return PARALLEL_WAIT_US * 4 + ADMIT_PARALLEL
        left_req = max(self._e[req_i].level, 0) // UNITS_PER_TOKEN if req_i >= 0 else 0
        left_tok = max(self._e[tok_i].level, 0) // UNITS_PER_TOKEN if tokens_step else 0
        return ~(left_req | left_tok << 32)


# --- Health (native/vx_health.c): breakers, in-flight gauges, per-upstream counters ----------

CLOSED, OPEN, HALF_OPEN = 0, 1, 2  # breaker states
PEEK_CLOSED, PEEK_PROBE, PEEK_OPEN, PEEK_PROBING = 0, 1, 2, 3
SUCCESS, FAILURE, NEUTRAL = 0, 1, 2  # outcomes
TR_NONE, TR_OPENED, TR_REOPENED, TR_CLOSED, TR_HALF_OPENED = 0, 1, 2, 3, 4
UP_REQUESTS, UP_SUCCESSES, UP_FAILURES, UP_RETRIES, UP_PANICS, UP_FULL = range(6)
_UP_COUNTERS = 6
MAX_UPSTREAMS = 4096
MAX_COUNT = 255  # failures / successes thresholds, and the counts the breaker word holds
MAX_PROBES = 63
MAX_OPEN_MS = 1 << 31
MAX_NOW_MS = (1 << 40) - 1
PENDING = 64  # transitions one process keeps until drained


class _Breaker:
    """The breaker word's fields (state, count, probes, streak, stamp) and its side counters."""

    __slots__ = ("state", "count", "probes", "streak", "stamp", "opened_at", "opens",
                 "in_flight", "cap", "counters")

    def __init__(self, cap: int) -> None:
        self.state = CLOSED
        self.count = self.probes = self.streak = self.stamp = 0
        self.opened_at = -1
        self.opens = 0
        self.in_flight = 0
        self.cap = cap
        self.counters = [0] * _UP_COUNTERS

    def set(self, state: int, count: int, probes: int, streak: int, stamp: int) -> None:
        """w_make: count and streak saturate at 255 (8 bits each)."""
        self.state, self.count, self.probes = state, min(count, MAX_COUNT), probes
        self.streak, self.stamp = min(streak, MAX_COUNT), stamp


class PyHealth:
    """The native Health's API, one process's breakers. now_ms None reads CLOCK_MONOTONIC."""

    def __init__(self, max_in_flight: Sequence[int], failures: int, successes: int,
                 open_ms: int, max_open_ms: int, probes: int, probe_lease_ms: int) -> None:
        self.failures = _in_range(failures, "failures", 1, MAX_COUNT)
        self.successes = _in_range(successes, "successes", 1, MAX_COUNT)
        self.open_ms = _in_range(open_ms, "open_ms", 1, MAX_OPEN_MS)
        self.max_open_ms = _in_range(max_open_ms, "max_open_ms", open_ms, MAX_OPEN_MS)
        self.probes = _in_range(probes, "probes", 1, MAX_PROBES)
        self.probe_lease_ms = _in_range(probe_lease_ms, "probe_lease_ms", 1, MAX_OPEN_MS)
        if not 1 <= len(max_in_flight) <= MAX_UPSTREAMS:
            raise ValueError(f"max_in_flight must hold 1 to {MAX_UPSTREAMS} entries")
        caps = [_in_range(c, "max_in_flight[i]", 0, _INT64[1]) for c in max_in_flight]
        self._up = [_Breaker(c) for c in caps]
        self._pending: list[tuple[int, int, int, int]] = []
        self._overflow = 0

    def __len__(self) -> int:
        return len(self._up)

    def _at(self, upstream: int) -> _Breaker:
        return self._up[_index(upstream, "upstream", len(self._up))]

    @staticmethod
    def _now(now_ms: int | None) -> int:
        if now_ms is None:
            return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1_000_000
        return _in_range(now_ms, "now_ms", 0, MAX_NOW_MS)

    def open_time(self, streak: int) -> int:
        """vx_breaker_open_ms: open_ms doubled per consecutive opening, capped."""
        ms = self.open_ms
        for _ in range(1, streak):
            if ms >= self.max_open_ms:
                break
            ms *= 2
        return min(ms, self.max_open_ms)

    def _peek(self, b: _Breaker, now: int) -> int:
        if b.state == CLOSED:
            return PEEK_CLOSED
        if b.state == OPEN:
            return PEEK_PROBE if now - b.stamp >= self.open_time(b.streak) else PEEK_OPEN
        if b.probes < self.probes or now - b.stamp >= self.probe_lease_ms:
            return PEEK_PROBE
        return PEEK_PROBING

    def _enter(self, b: _Breaker, now: int) -> tuple[int, int]:
        """(probe_slot, transition): -1 denied, 0 closed, else stamp + 1 of the half-open period."""
        if b.state == CLOSED:
            return 0, TR_NONE
        if b.state == OPEN:
            if now - b.stamp < self.open_time(b.streak):
                return -1, TR_NONE
            b.set(HALF_OPEN, 0, 1, b.streak, now)  # this caller is the first probe
            return now + 1, TR_HALF_OPENED
        if b.probes < self.probes:
            b.probes += 1
            return b.stamp + 1, TR_NONE
        if now - b.stamp >= self.probe_lease_ms:  # every slot held past the lease: start over
            b.set(HALF_OPEN, b.count, 1, b.streak, now)
            return now + 1, TR_NONE
        return -1, TR_NONE

    def _report(self, b: _Breaker, probe_slot: int, outcome: int, now: int) -> int:
        tr = TR_NONE
        if b.state == CLOSED:
            if outcome == SUCCESS:
                if b.count:
                    b.set(CLOSED, 0, 0, b.streak, 0)
            elif outcome == FAILURE:
                if b.count + 1 >= self.failures:
                    b.set(OPEN, 0, 0, b.streak + 1, now)
                    tr = TR_OPENED
                else:
                    b.set(CLOSED, b.count + 1, 0, b.streak, 0)
        elif b.state == HALF_OPEN and probe_slot == b.stamp + 1:  # a probe of this period
            probes = max(b.probes - 1, 0)
            if outcome == SUCCESS:
                if b.count + 1 >= self.successes:
                    b.set(CLOSED, 0, 0, 0, 0)
                    tr = TR_CLOSED
                else:
                    b.set(HALF_OPEN, b.count + 1, probes, b.streak, b.stamp)
            elif outcome == FAILURE:
                b.set(OPEN, 0, 0, b.streak + 1, now)
                tr = TR_REOPENED
            else:
                b.set(HALF_OPEN, b.count, probes, b.streak, b.stamp)
        if tr in (TR_OPENED, TR_REOPENED):
            b.opened_at = now
            b.opens += 1
        return tr

    def _note(self, upstream: int, tr: int, now: int) -> None:
        if tr == TR_NONE:
            return
        if len(self._pending) == PENDING:
            self._overflow += 1
            return
        b = self._up[upstream]
        opened = tr in (TR_OPENED, TR_REOPENED)
        self._pending.append((upstream, tr, now, self.open_time(max(b.streak, 1)) if opened
                              else 0))

    def _full(self, b: _Breaker) -> bool:
        return b.cap > 0 and max(b.in_flight, 0) >= b.cap

    def peek(self, upstream: int, now_ms: int | None = None, /) -> int:
        b = self._at(upstream)
        return self._peek(b, self._now(now_ms))

    def check(self, upstream: int, now_ms: int | None = None, /) -> int:
        b = self._at(upstream)
        if self._peek(b, self._now(now_ms)) >= PEEK_OPEN:
            return 1
        return 2 if self._full(b) else 0

    def usable_mask(self, upstreams: tuple[int, ...], now_ms: int | None, /) -> int:
        now = self._now(now_ms)
        if type(upstreams) is not tuple or len(upstreams) > 64:
            raise TypeError("upstreams must be a tuple of at most 64 indices")
        mask = 0
        for k, upstream in enumerate(upstreams):
            b = self._at(upstream)
            if self._peek(b, now) < PEEK_OPEN and not self._full(b):
                mask |= 1 << k
        return mask

    def in_flight_sum(self, upstreams: tuple[int, ...], /) -> int:
        return sum(self.in_flight(u) for u in upstreams)

    def allow(self, upstream: int, now_ms: int | None, /) -> int:
        b = self._at(upstream)
        now = self._now(now_ms)
        probe_slot, tr = self._enter(b, now)
        if probe_slot < 0:
            return -1
        self._note(upstream, tr, now)
        if not self.acquire(upstream):
            self._report(b, probe_slot, NEUTRAL, now)  # its probe slot back
            return -2
        b.counters[UP_REQUESTS] += 1
        return probe_slot

    def finish(self, upstream: int, probe_slot: int, outcome: int, now_ms: int | None, /) -> None:
        b = self._at(upstream)
        _in_range(probe_slot, "probe_slot", 0, _INT64[1])
        _in_range(outcome, "outcome", 0, 2)
        now = self._now(now_ms)
        b.in_flight -= 1
        self._note(upstream, self._report(b, probe_slot, outcome, now), now)
        if outcome == SUCCESS:
            b.counters[UP_SUCCESSES] += 1
        elif outcome == FAILURE:
            b.counters[UP_FAILURES] += 1

    def enter(self, upstream: int, now_ms: int | None = None, /) -> int:
        b = self._at(upstream)
        now = self._now(now_ms)
        probe_slot, tr = self._enter(b, now)
        self._note(upstream, tr, now)
        return probe_slot

    def report(self, upstream: int, probe_slot: int, outcome: int,
               now_ms: int | None = None, /) -> int:
        b = self._at(upstream)
        _in_range(probe_slot, "probe_slot", 0, _INT64[1])
        _in_range(outcome, "outcome", 0, 2)
        now = self._now(now_ms)
        tr = self._report(b, probe_slot, outcome, now)
        self._note(upstream, tr, now)
        return tr

    def breaker(self, upstream: int, now_ms: int | None = None, /
                ) -> tuple[int, int, int, int, int, int, int, int]:
        b = self._at(upstream)
        now = self._now(now_ms)
        until = max(b.stamp + self.open_time(b.streak) - now, 0) if b.state == OPEN else 0
        return (b.state, b.count, b.probes, b.streak, b.stamp, b.opened_at, b.opens, until)

    def transitions(self) -> tuple[list[tuple[int, int, int, int]], int]:
        out = (self._pending, self._overflow)
        self._pending, self._overflow = [], 0
        return out

    def acquire(self, upstream: int, /) -> bool:
        b = self._at(upstream)
        if b.cap > 0 and b.in_flight >= b.cap:
            b.counters[UP_FULL] += 1
            return False
        b.in_flight += 1
        return True

    def release(self, upstream: int, /) -> None:
        self._at(upstream).in_flight -= 1

    def in_flight(self, upstream: int, /) -> int:
        return max(self._at(upstream).in_flight, 0)

    def max_in_flight(self, upstream: int, /) -> int:
        return self._at(upstream).cap

    def count(self, upstream: int, field: int, n: int = 1, /) -> None:
        b = self._at(upstream)
        b.counters[_index(field, "field", _UP_COUNTERS)] += _in_range(n, "n", 0, _INT64[1])

    def counter(self, upstream: int, field: int, /) -> int:
        return self._at(upstream).counters[_index(field, "field", _UP_COUNTERS)]
