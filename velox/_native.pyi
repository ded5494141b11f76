"""Private native core of Velox (C extension `velox._native`).

Do not import this module directly: the public faces are velox.ingress.ring,
velox.admission.ratelimit, velox.state.stats and velox.state.health. Errors: ValueError for bad
values (integers too large for int64 included, never OverflowError), TypeError for wrong types,
IndexError for slot/field out of range.
"""

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Final, Literal, final

from typing_extensions import Buffer

@final
class Ring:
    """Bounded lock-free MPMC FIFO (Vyukov ring) of Python objects.

    The ring holds one strong reference per stored item; items still inside when the ring is
    destroyed are released, and the garbage collector sees them. `try_pop` returns None when
    the ring is empty, so a stored None cannot be told apart from "empty": do not store None.
    """

    def __init__(self, capacity: int) -> None:
        """capacity: a power of two in [2, 2**30]; anything else raises ValueError."""
    def try_push(self, obj: object, /) -> bool:
        """Store obj (a new reference is taken). False when full; never blocks or grows."""
    def try_pop(self) -> object | None:
        """The oldest item (its reference passes to the caller), or None when empty."""
    def pop_batch(self, max_n: int = 64, /) -> list[object]:
        """Up to max_n oldest items in FIFO order, [] when empty; one C call.

        max_n <= 0 raises ValueError.
        """
    def __len__(self) -> int:
        """Items stored; approximate while other threads push or pop."""
    @property
    def capacity(self) -> int: ...

@final
class Counters:
    """slots x fields int64 counters in an anonymous shared mapping (shared across fork).

    Each slot's row starts on its own 64-byte cache line; one slot per worker process.
    """

    def __init__(self, slots: int, fields: int, *, memfd: bool = False) -> None:
        """slots in [1, 4096], fields in [1, 4096]; otherwise ValueError. memfd=True: on a
        memfd, so a process that did not inherit it can map it (fd(), attach())."""
    def fd(self) -> int:
        """A new descriptor of the memfd (memfd=True; the caller closes it), else ValueError."""
    @classmethod
    def attach(cls, fd: int, slots: int, fields: int, /) -> Counters:
        """The counters of that shape another process made with memfd=True, mapped from a
        descriptor of its memfd (kept the caller's); ValueError for a file of another size."""
    def add(self, slot: int, field: int, n: int = 1, /) -> None:
        """Relaxed atomic fetch_add. IndexError on a bad slot or field."""
    def add_many(self, slot: int, *field_n: int) -> None:
        """add() of each (field, n) pair of the arguments (1 to 16 pairs) to one slot, in one
        call; every argument is checked (IndexError, TypeError) before anything is added."""
    def set(self, slot: int, field: int, value: int, /) -> None:
        """Relaxed atomic store, for gauges."""
    def get(self, slot: int, field: int, /) -> int: ...
    def totals(self) -> list[int]:
        """Per-field sums over all slots."""
    def snapshot(self) -> list[list[int]]:
        """Per-slot rows."""
    @property
    def slots(self) -> int: ...
    @property
    def fields(self) -> int: ...

@final
class Histogram:
    """One log-linear latency histogram per slot, in an anonymous shared mapping.

    Values in microseconds, 1 us to 10 min: exact below 128, above that 64 sub-buckets per
    power of two (bucket width <= 1/64 of its value, reported midpoints within 1/128).
    Larger values are counted in the top bucket; negative values count as 0.
    """

    def __init__(self, slots: int) -> None:
        """slots in [1, 4096]; otherwise ValueError."""
    def record(self, slot: int, value_us: int, /) -> None:
        """Lock-free: relaxed fetch_add on the bucket, the count and the sum."""
    def percentiles(self, qs: Sequence[float], slot: int = -1) -> list[int]:
        """Nearest-rank quantiles, each q in (0, 1], of one slot or (slot=-1) of all slots
        merged. Bucket midpoints (exact below 128); 0 when empty."""
    def count(self, slot: int = -1) -> int: ...
    def total_us(self, slot: int = -1) -> int:
        """Sum of the recorded values."""
    def buckets(self, slot: int = -1) -> list[tuple[int, int]]:
        """(upper_bound_us_inclusive, count) for the non-empty buckets, ascending."""
    @property
    def slots(self) -> int: ...

# ---------------------------------------------------------------- JSON request scanner

# Kinds (JSON type of a value); JSON_ABSENT: key not present / top level not an object.
JSON_ABSENT: Final[int]  # 0
JSON_NULL: Final[int]  # 1
JSON_FALSE: Final[int]  # 2
JSON_TRUE: Final[int]  # 3
JSON_NUMBER: Final[int]  # 4
JSON_STRING: Final[int]  # 5
JSON_ARRAY: Final[int]  # 6
JSON_OBJECT: Final[int]  # 7

# Error codes. Only "JSON_OK or not" is guaranteed to match orjson; the code is a best effort.
JSON_OK: Final[int]  # 0
JSON_E_EMPTY: Final[int]  # 1: empty or whitespace-only
JSON_E_TRUNCATED: Final[int]  # 2: input ends inside a value
JSON_E_SYNTAX: Final[int]  # 3: unexpected byte
JSON_E_TRAILING: Final[int]  # 4: content after the top-level value
JSON_E_DEPTH: Final[int]  # 5: more than JSON_MAX_DEPTH nested arrays/objects
JSON_E_NUMBER: Final[int]  # 6: malformed number
JSON_E_RANGE: Final[int]  # 7: number that is +-infinity as a double (orjson refuses those)
JSON_E_CONTROL: Final[int]  # 8: raw byte < 0x20 in a string
JSON_E_ESCAPE: Final[int]  # 9: bad backslash escape
JSON_E_SURROGATE: Final[int]  # 10: lone surrogate in a \u escape
JSON_E_UTF8: Final[int]  # 11: ill-formed UTF-8 in a string
JSON_E_TOO_LARGE: Final[int]  # 12: 2**60 bytes or more
JSON_MAX_DEPTH: Final[int]  # 1024, as orjson

def scan_json(buf: Buffer, /) -> tuple[int, int, int, int, int, int, int]:
    """Validate buf as one JSON text and locate the top-level "model" and "stream" keys.

    Accepts exactly what orjson.loads accepts (differentially tested). Returns
    (error, error_offset, model_start, model_end, model_kind, stream_kind, top_kind):

    - error: JSON_OK (0) or a JSON_E_* code; error_offset: byte offset where validation
      failed (len(buf) when the input ends too early), 0 on success. On error every other
      item is 0.
    - model_start, model_end: byte span of the value of the top-level "model" key (quotes
      included for a string: orjson.loads(buf[model_start:model_end]) is its value); 0, 0
      when absent. model_kind: its JSON_* kind, JSON_ABSENT when absent.
    - stream_kind: kind of the top-level "stream" value: JSON_TRUE / JSON_FALSE for the
      literals, JSON_ABSENT when absent, any other kind otherwise.
    - top_kind: kind of the top-level value; fields are reported only for JSON_OBJECT.

    Keys are compared after unescaping; a repeated key reports its last occurrence (as
    orjson). Keys of nested objects are ignored. buf is any C-contiguous buffer (bytes,
    bytearray, memoryview); others raise BufferError or TypeError. From 64 KiB on the GIL is
    released during the scan, so a thread can scan a large body while the event loop runs;
    do not modify the buffer meanwhile (a bytearray cannot be resized during the scan).
    """

# Shared per-upstream health (vx_health). The public face is velox.state.health.
BREAKER_CLOSED: Final[int]  # 0
BREAKER_OPEN: Final[int]  # 1
BREAKER_HALF_OPEN: Final[int]  # 2
PEEK_CLOSED: Final[int]  # 0: admitted
PEEK_PROBE: Final[int]  # 1: admitted as a probe
PEEK_OPEN: Final[int]  # 2: refused, open and not yet due
PEEK_PROBING: Final[int]  # 3: refused, half-open with every probe slot taken
OUTCOME_SUCCESS: Final[int]  # 0
OUTCOME_FAILURE: Final[int]  # 1: upstream-caused
OUTCOME_NEUTRAL: Final[int]  # 2: neither (client left, gateway refused): frees a probe slot
TR_NONE: Final[int]  # 0
TR_OPENED: Final[int]  # 1: closed -> open (this caller was the one opener)
TR_REOPENED: Final[int]  # 2: half-open -> open
TR_CLOSED: Final[int]  # 3: half-open -> closed
TR_HALF_OPENED: Final[int]  # 4: open -> half-open (enter/admit: this caller is its probe)
UP_REQUESTS: Final[int]  # 0
UP_SUCCESSES: Final[int]  # 1
UP_FAILURES: Final[int]  # 2
UP_RETRIES: Final[int]  # 3
UP_PANICS: Final[int]  # 4
UP_FULL: Final[int]  # 5: refused by max_in_flight (counted by acquire)
UP_COUNTERS: Final[int]  # 6

@final
class Health:
    """Per-upstream circuit breakers, in-flight gauges and counters in one shared mapping.

    One entry per item of max_in_flight (1 to 4096). Created before fork(), one state for the
    parent and every child. now_ms arguments are CLOCK_MONOTONIC milliseconds; None (or
    omitted) reads the clock. Policy bounds: failures and successes [1, 255], open_ms
    [1, 2**31], max_open_ms [open_ms, 2**31], probes [1, 63], probe_lease_ms [1, 2**31].
    """

    def __init__(
        self,
        max_in_flight: Sequence[int],
        failures: int,
        successes: int,
        open_ms: int,
        max_open_ms: int,
        probes: int,
        probe_lease_ms: int,
    ) -> None: ...
    def __len__(self) -> int: ...
    def peek(self, upstream: int, now_ms: int | None = None, /) -> int:
        """PEEK_*: what a request would get now, taking nothing."""
    def check(self, upstream: int, now_ms: int | None = None, /) -> int:
        """0: a request could go now; 1: the breaker refuses (open, or probe slots taken);
        2: max_in_flight reached. Takes nothing."""
    def usable_mask(self, upstreams: tuple[int, ...], now_ms: int | None, /) -> int:
        """Bit k set when check(upstreams[k], now_ms) == 0 (at most 64 upstreams)."""
    def in_flight_sum(self, upstreams: tuple[int, ...], /) -> int:
        """Sum of in_flight() over the upstreams, in one call."""
    def allow(self, upstream: int, now_ms: int | None, /) -> int:
        """enter() + acquire() + count(UP_REQUESTS): a probe slot >= 0, or -1 (breaker refuses) /
        -2 (max_in_flight reached), having taken nothing."""
    def finish(self, upstream: int, probe_slot: int, outcome: int, now_ms: int | None, /) -> None:
        """release() + report() + count UP_SUCCESSES / UP_FAILURES."""
    def enter(self, upstream: int, now_ms: int | None = None, /) -> int:
        """-1 refused, 0 admitted (closed), > 0 a probe slot; probe slots >= 0 go to report()."""
    def report(
        self, upstream: int, probe_slot: int, outcome: int, now_ms: int | None = None, /
    ) -> int:
        """Outcome (OUTCOME_*) of a request admitted with probe_slot; returns the TR_* it caused."""
    def breaker(
        self, upstream: int, now_ms: int | None = None, /
    ) -> tuple[int, int, int, int, int, int, int, int]:
        """(state, count, probes, streak, stamp_ms, opened_at_ms, open_count,
        until_half_open_ms) from one read of the breaker word."""
    def transitions(self) -> tuple[list[tuple[int, int, int, int]], int]:
        """The breaker transitions this process made since the last call, and forgets them:
        ([(upstream, TR_*, at_ms, open_ms), ...], how many did not fit). Each transition is
        made by one caller in one process: draining every process lists it once."""
    def acquire(self, upstream: int, /) -> bool:
        """One in-flight place; False (and UP_FULL counted) when max_in_flight is reached."""
    def release(self, upstream: int, /) -> None: ...
    def in_flight(self, upstream: int, /) -> int: ...
    def max_in_flight(self, upstream: int, /) -> int: ...
    def count(self, upstream: int, field: int, n: int = 1, /) -> None: ...
    def counter(self, upstream: int, field: int, /) -> int: ...
    @property
    def policy(self) -> dict[str, int]: ...

@final
class RetryBudget:
    """Gateway-wide retry budget in shared memory (created before fork()).

    A retry at second s (now_ms // 1000) is granted only if, counting it,
    100 * retries <= percent * requests + 100 * min_per_s * window_s, both summed over the
    window_s seconds ending at s. percent [0, 1000], window_s [1, 3600], min_per_s [0, 10**6].
    """

    def __init__(self, percent: int, window_s: int, min_per_s: int) -> None: ...
    def record_request(self, now_ms: int | None = None, /) -> int:
        """Count one request; the second it was charged to (-1: not counted)."""
    def try_retry(self, now_ms: int | None = None, /) -> bool: ...
    def window(self, now_ms: int | None = None, /) -> tuple[int, int]:
        """(requests, retries) over the window ending now (a metric)."""
    @property
    def percent(self) -> int: ...
    @property
    def window_s(self) -> int: ...
    @property
    def min_per_s(self) -> int: ...
    # Test hook, not API.
    def _try_retry_at(self, now_ms: int, /) -> int:
        """try_retry returning the second charged, or -1."""

def hash64(data: Buffer, seed: int = 0, /) -> int:
    """Stable 64-bit hash (the same in every process, run and little-endian machine)."""

@final
class Rendezvous:
    """Weighted rendezvous hashing over 1 to 64 targets named by 64-bit seeds.

    Target i wins a key with probability weights[i] / sum(weights) (weights in (0, 1e9]);
    removing a target moves only the keys it held.
    """

    def __init__(self, seeds: Sequence[int], weights: Sequence[float]) -> None: ...
    def __len__(self) -> int: ...
    def rank(self, key_hash: int, /) -> tuple[int, ...]:
        """Target indices by score for key_hash, best first."""
    def first(self, key_hash: int, /) -> int:
        """rank(key_hash)[0]."""

# Shared response cache store (vx_cache), used by the worker's cache stage.
@final
class SharedCache:
    """The gateway-wide response cache store: one exact LRU of (32-byte key -> bytes) with
    per-entry TTLs, plus in-flight markers for cross-worker coalescing.

    One anonymous shared mapping, created before fork(): one cache for the parent and every
    child. Its memory (index, markers and entries) is bounded by capacity_bytes plus 512
    bytes (the header; the kernel rounds the mapping up to whole pages); pages are resident
    only once used. Entries are chains of 512-byte blocks (the
    first carries a 72-byte header), so `stats()["bytes"]` counts values plus that overhead.
    Keys are exactly 32 bytes (any bytes-like object; ValueError for another length). Values
    are any bytes-like object. Times are CLOCK_MONOTONIC milliseconds supplied by the caller
    (velox.state.health.now_ms()), in [0, 2**50]; ttl_ms and hold_ms in [1, 2**50]. Process- and
    thread-safe under one robust process-shared lock: a process killed while holding it costs
    the others one wipe of the cache (counted in stats()["recoveries"]), never a hang. Values
    of 64 KiB or more are copied with the GIL released. OSError only if the lock is unusable.
    """

    def __init__(self, capacity_bytes: int) -> None:
        """capacity_bytes in [65536, 2**40]; otherwise ValueError."""
    def get(self, key: Buffer, now_ms: int,
            max_age_ms: int | None = -1) -> tuple[bytes, int] | None:
        """(value, age_ms) of a fresh entry, which becomes the most recently used; else None.

        An entry past its own TTL (now_ms >= stored + ttl_ms) is removed and None returned;
        one older than max_age_ms (>= 0; -1 or None: no limit) is left alone (not promoted)
        and None returned. age_ms = now_ms - stored time, never negative.
        """
    def put(self, key: Buffer, value: Buffer, now_ms: int, ttl_ms: int) -> bool:
        """Insert or replace; evicts least recently used entries until it fits. False (nothing
        stored, an existing entry for key kept) when len(value) > max_value."""
    def delete(self, key: Buffer, /) -> bool:
        """Remove key's entry; True when there was one."""
    def claim(self, key: Buffer, now_ms: int, hold_ms: int) -> bool:
        """In-flight marker for cross-worker coalescing, owned by the calling process (its
        pid), with a lease of hold_ms.

        True: the caller now leads: no marker existed (one is set, expiring at now_ms +
        hold_ms), or the marker was dead (expired, or its owner process no longer exists:
        the caller takes it over and the waiter count is kept), or the marker table is full
        (the caller leads without a marker: no coalescing for that key). False: a live marker
        exists; the caller is counted as a waiter (and must unwait() when it stops waiting).
        The same process claiming twice is counted as a waiter the second time.
        """
    def renew(self, key: Buffer, now_ms: int, hold_ms: int) -> bool:
        """The leader extends its lease to now_ms + hold_ms. True when key's marker is this
        process's; False when there is none or another process took it over."""
    def unwait(self, key: Buffer, /) -> None:
        """A waiter stops waiting: waiters -= 1 (never below 0; no-op without a marker)."""
    def waiting(self, key: Buffer, /) -> int:
        """Waiters on key's marker now (0 without a marker, expired or not)."""
    def release(self, key: Buffer, /) -> bool:
        """The leader drops its marker (after put, or after failing); True when there was one
        and it was this process's (a marker another process took over is left alone).
        (PLAN: returns nothing; the bool is an addition.)"""
    def pending(self, key: Buffer, now_ms: int) -> bool:
        """True when a live marker exists for key: unexpired, and its owner process still
        exists (a process that is gone is seen once reaped)."""
    def stats(self) -> dict[str, int]:
        """A consistent snapshot. entries, bytes (blocks in use x block_size), capacity,
        evictions, expired, max_value, markers (in the table, live or expired), and:
        value_bytes, hits, misses (expired and stale included), stale (older than
        max_age_ms), stores, replaced, rejected (too large), claims, takeovers,
        markers_full, recoveries (lock holders found dead: each wiped the cache),
        marker_slots, blocks, block_size, mapped (the mapping's size)."""
    def clear(self) -> None:
        """Drop every entry and marker; counters are kept."""
    @property
    def capacity(self) -> int:
        """capacity_bytes as given."""
    @property
    def max_value(self) -> int:
        """The largest value put() stores: about an eighth of the pool (64 MiB: ~8 MiB)."""
    # Test hooks, not API.
    def _check(self) -> int:
        """Walk every structure and check the invariants: 0, or the first broken one's code."""
    def _lock_and_hold(self, hold_ms: int, /) -> None:
        """Take the lock and keep it hold_ms (<= 60000) with the GIL released."""
    def _holding(self) -> bool:
        """True while some process is inside _lock_and_hold."""
LIMITS_NEVER: Final[int]  # -1: Limits.take can never succeed (n > burst, or unconfigured)
LIMITS_LEASE_WAIT_US: Final[int]  # 1000000: take's answer for a leased bucket short of tokens
ADMIT_REQUESTS: Final[int]  # 1: Limits.admit refused on the request bucket
ADMIT_TOKENS: Final[int]  # 2: ... on the token bucket
ADMIT_PARALLEL: Final[int]  # 3: ... on the gauge (max_parallel)
ADMIT_LEFT_SHIFT: Final[int]  # 32: admitted, ~admit() = requests left | tokens left << this
ADMIT_REASON_BITS: Final[int]  # 2: refused, admit() = wait_us << this | reason

@final
class Limits:
    """n token buckets and n concurrency gauges in one anonymous shared mapping.

    Created before fork() (like TokenBucket): one state for the parent and every worker. The
    owner of a table (keys, upstreams, the gateway) assigns indexes; entry i is a bucket
    (integer tokens, CLOCK_MONOTONIC microseconds, lock-free CAS) and a gauge of places held.
    Entries start unconfigured: take answers -1 until configure().

    Buckets. `configure(i, rate, burst)`: rate tokens per minute refilled from the clock (each
    take refills first, so time spent full is never credited), at most burst held. Rate 0 is
    a LEASED bucket: no clock refill, only give() adds (Redis leases feed it). A bucket in debt
    (level < 0, after charge()) refuses every take until refills or gives repay it.
    Exact: tokens taken <= burst + rate * elapsed / 60e6 + tokens given, whatever races.

    Gauges. enter/leave count places per worker slot (0 <= slot < slots) as well as in total,
    so forget_slot(slot) gives back what a SIGKILLed worker held. The supervisor calls it
    after reaping the worker, before a new one starts in that slot.

    now_us arguments are test hooks: None (the default) reads CLOCK_MONOTONIC.
    """

    def __init__(self, n: int, slots: int = 64, *, memfd: bool = False) -> None:
        """n in [1, 10**6], slots in [1, 4096]; otherwise ValueError naming the argument.
        memfd=True: on a memfd, so a process that did not inherit it can map it (fd(),
        attach())."""
    def fd(self) -> int:
        """A new descriptor of the memfd (memfd=True; the caller closes it), else ValueError."""
    @classmethod
    def attach(cls, fd: int, /) -> Limits:
        """The Limits another process made with memfd=True, mapped from a descriptor of its
        memfd (kept the caller's): the same buckets and gauges. ValueError when the file is
        not a whole Limits mapping."""
    def __len__(self) -> int: ...
    @property
    def slots(self) -> int: ...
    def configure(
        self, i: int, rate_per_minute: int, burst: int, now_us: int | None = None, /
    ) -> None:
        """rate [0, 10**9] (0: leased), burst [1, 10**9]. The first configure starts the bucket
        full (leased: empty); a later one credits the old rate up to now, then keeps the
        level capped at the new burst (debt kept)."""
    def config(self, i: int, /) -> tuple[int, int]:
        """(rate_per_minute, burst); (0, 0) when never configured."""
    def take(self, i: int, n: int, now_us: int | None = None, /) -> int:
        """Take n >= 1 tokens at once or none. 0: taken. > 0: microseconds until n could be
        available, nothing taken (leased: LIMITS_LEASE_WAIT_US). -1: never (n > burst)."""
    def give(self, i: int, n: int, /) -> int:
        """Deposit n >= 0 tokens, the level capped at burst; returns the whole tokens that
        went in. taken() is unchanged (a lease is not consumption)."""
    def refund(self, i: int, n: int, /) -> int:
        """give() back n >= 0 tokens taken and not used: taken() goes down by n."""
    def charge(self, i: int, n: int, /) -> None:
        """Take n >= 0 tokens unconditionally (settling over-use); the level may go negative
        (debt, floored at -10**10 tokens)."""
    def level(self, i: int, now_us: int | None = None, /) -> int:
        """Whole tokens now, pending refill included, capped at burst; negative in debt.
        Approximate under concurrency (for headers and metrics)."""
    def taken(self, i: int, /) -> int:
        """Cumulative tokens taken or charged, minus refunds (rates, lease sizing)."""
    def refused(self, i: int, /) -> int:
        """Cumulative tokens of takes refused for want of tokens (demand taken() misses)."""
    def pop_largest(self, i: int, /) -> int:
        """The largest take asked (admitted or refused) since the last call; resets it."""
    def enter(self, i: int, limit: int, slot: int, /) -> bool:
        """Take a place of gauge i for the worker in slot; False (nothing taken) when limit
        places are held across the gateway. limit <= 0: no limit, count only."""
    def leave(self, i: int, slot: int, /) -> bool:
        """Give back a place this slot took; False (nothing changed) when it holds none."""
    def active(self, i: int, /) -> int:
        """Places of gauge i held across the gateway."""
    def held(self, i: int, slot: int, /) -> int:
        """Places of gauge i held by the worker in slot."""
    def entered(self, i: int, /) -> int:
        """Places of gauge i ever taken (a counter: requests admitted)."""
    def forget_slot(self, slot: int, /) -> int:
        """Give back every place held by the (dead) worker of slot; returns how many."""
    def admit(self, req_i: int, tok_i: int, tokens: int, gauge_i: int, limit: int, slot: int,
              now_us: int | None = None, /) -> int:
        """One admission in one call (the keys stage's per-request path): take 1 from bucket
        req_i, then `tokens` (>= 0) from bucket tok_i, then a place of gauge gauge_i (limit,
        slot); an index of -1 skips its step. All or nothing: a refusal refunds what the
        earlier steps took. Admitted: a negative number; ~result holds the whole tokens left
        in req_i (low 32 bits) and in tok_i (the bits above), 0 for a skipped step (for the
        x-ratelimit-remaining-* headers). Refused: wait_us * 4 + reason > 0 (ADMIT_REQUESTS,
        ADMIT_TOKENS, ADMIT_PARALLEL); wait_us is take()'s answer (0 for never) or 1 s for a
        full gauge."""
    def ticket(self, key: object, rpm_i: int, tok_i: int, slot: int, reserved: int, /
               ) -> KeyTicket:
        """The ticket of a request admit() admitted (velox.admission.keys): release() leaves gauge
        rpm_i for slot, settle(used) corrects bucket tok_i's reservation (tok_i < 0: settled)."""
    # Test hook, not API.
    def _hammer(self, i: int, duration_us: int, n: int, /) -> int:
        """With the GIL released, take(i, n) on the real clock in a loop for duration_us (at
        most 60 s); return the tokens admitted."""

@final
class BudgetGate:
    """One worker's admission to and settlement of spend budgets (native/bind_budgets.c):
    budget b is bucket b of `limits`, counting units of units[b] nano-USD, and field b of row
    `slot` of `in_flight` the units its requests in flight reserve."""

    def __init__(self, limits: Limits, in_flight: Counters, units: tuple[int, ...],
                 slot: int) -> None: ...
    @property
    def carry(self) -> tuple[int, ...]:
        """Per budget, nano-USD of settled costs below one unit, not yet charged."""
    def admit(self, budgets: tuple[int, ...], estimate: int, /) -> bytes | int:
        """Refused (nothing taken) while a budget has nothing left: that budget's index. Else
        ceil(estimate / unit) taken from each (into debt when less is left) and counted in
        the slot's row; returns what the tightest budget had left, as USD text."""
    def settle(self, budgets: tuple[int, ...], estimate: int, cost: int, /) -> None:
        """The reservation of a request admitted with `estimate` becomes its `cost`."""

# The native HTTP/2 client codec (native/vx_h2.c); velox.egress.nativecodec is its face.
H2_RESPONSE: Final[int]  # 1, as velox.egress.codec.RESPONSE
H2_DATA: Final[int]  # 2
H2_TRAILERS: Final[int]  # 3
H2_RESET: Final[int]  # 4
H2_GOAWAY: Final[int]  # 5
H2_SETTINGS: Final[int]  # 6
H2_PING_ACK: Final[int]  # 7
H2_ANSWER: Final[int]  # 8
H2_LOCAL_INITIAL_WINDOW_SIZE: Final[int]
H2_LOCAL_CONNECTION_WINDOW: Final[int]
H2_LOCAL_MAX_HEADER_LIST_SIZE: Final[int]
H2_DATA_PER_CALL: Final[int]
H2_DEFAULT_MAX_CONCURRENT_STREAMS: Final[int]
H2_MAX_CONCURRENT_STREAMS_CAP: Final[int]

class H1Reader:
    """The reading half of an HTTP/1.1 upstream connection (velox.egress.h1conn subclasses it
    with asyncio.BufferedProtocol): responses parsed by vx_h1resp, reported to the subclass's
    _h_answer/_h_head/_h_body/_h_end/_h_error/_h_fallback (and _h_withhold) once per read."""

    read_buffer: memoryview  # read-only attribute: the buffer uvloop reads into
    no_body: int  # nonzero while the request answered is HEAD
    native_fallback: int  # read-only: nonzero once httptools reads the connection

    def get_buffer(self, sizehint: int, /) -> memoryview: ...
    def buffer_updated(self, nbytes: int, /) -> None: ...
    def data_received(self, data: Buffer, /) -> None: ...
    def direct(self, conn: Any, write: Any, sse: Any, exchange: Any, attempt: Any,
               chunked: bool, /) -> None:
        """A streamed answer's plain reads go to write (the client transport's) from here on."""
    def undirect(self) -> None: ...

class H2Reader:
    """The reading half of an HTTP/2 upstream connection (velox.egress.h2conn subclasses it
    with asyncio.BufferedProtocol): with the native codec each read is parsed in C and reaches
    the subclass's _h_events(events) only when it left events or output; a CodecError goes to
    _h_failed(exc); with another codec every read goes to data_received(bytes)."""

    read_buffer: memoryview  # read-only attribute: the buffer uvloop reads into
    codec: Any  # the connection's codec
    reads: int  # reads so far

    def get_buffer(self, sizehint: int, /) -> memoryview: ...
    def buffer_updated(self, nbytes: int, /) -> None: ...

@final
class H2Client:
    """velox.egress.codec.Codec in C; errors are raised as error_class(code, message, events)."""

    def __init__(self, authority: bytes, scheme: bytes, error_class: type[Exception]) -> None: ...
    def initiate(self) -> None: ...
    def send_request(
        self,
        method: bytes,
        path: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: Buffer | None,
        /,
    ) -> int: ...
    def receive_data(self, data: Buffer, /) -> list[tuple[Any, ...]]: ...
    def receive_answers(self, data: Buffer, /) -> list[tuple[Any, ...]]:
        """receive_data, with RESPONSE + the DATA ending it next as one ANSWER event
        (velox.egress.codec.ANSWER), its flow-controlled length acknowledged."""
    def data_to_send(self) -> bytes: ...
    @property
    def data_pending(self) -> bool: ...
    @property
    def has_output(self) -> bool: ...
    def acknowledge(self, stream_id: int, n: int, /) -> None: ...
    def reset_stream(self, stream_id: int, error_code: int = 8, /) -> None: ...
    def send_ping(self, opaque: Buffer, /) -> None: ...
    def close(self, error_code: int = 0, /) -> None: ...
    @property
    def max_concurrent_streams(self) -> int: ...
    @property
    def next_stream_id(self) -> int: ...
    @property
    def stream_state_count(self) -> int: ...
    def direct(self, stream_id: int, conn: Any, write: Any, sse: Any, exchange: Any,
               attempt: Any, chunked: bool, /) -> bool:
        """The stream's plain DATA go to write (the client transport's) from here on, and
        are credited here (native/bind_sink.h); False when the codec holds no state for it."""
    def undirect(self, stream_id: int, /) -> None: ...

def sink_piece(data: bytes, metered: bool, strip: bool, /) -> bytes | None:
    """What the direct path writes of one streamed read (unframed), or None: the Python path
    reads it (twin: velox.relay.twins.sink_piece)."""
# HTTP/1.1 response writer (native/vx_http1.c); the face is velox.ingress.h1write.
H1_LENGTH: Final[int]  # write content-length
H1_CHUNKED: Final[int]  # write transfer-encoding: chunked
H1_CLOSE: Final[int]  # write connection: close

def h1_response(status_line: bytes, headers: Sequence[tuple[bytes, bytes]],
                body: Buffer | Sequence[Buffer] | None, flags: int, /) -> bytes:
    """Status line, [content-length: len(body)], the headers in order, [transfer-encoding:
    chunked], [connection: close], blank line, body (pieces joined). headers: a list or tuple
    of (name, value) bytes pairs (TypeError otherwise); flags outside H1_* raise ValueError."""
def h1_head(status_line: bytes, headers: Sequence[tuple[bytes, bytes]], content_length: int,
            flags: int, /) -> bytes:
    """The head alone, content-length as given (in [0, 2**60)), for HEAD answers and streams."""
def h1_chunks(data: Buffer | Sequence[Buffer], last: bool = False, /) -> bytes:
    """Each non-empty piece framed as one chunk, then the last chunk if `last`."""
def h1_server_timing(t_received: int, t_popped: int, t_parsed: int, t_admitted: int,
                     t_sent: int, t_headers: int, /) -> bytes:
    """server-timing value: ring, parse, ratelimit, upstream as milliseconds (3 decimals)."""
# HTTP/1.1 request-head parser (native/vx_reqhead.c); used by velox.ingress.connection's native
# path.
REQHEAD_PARTIAL: Final[int]  # an incomplete head this long falls back to httptools
REQHEAD_FIELDS: Final[int]  # a head with more fields falls back to httptools

def reqhead(buf: Buffer, start: int, max_header_bytes: int, drop: frozenset[bytes], /) -> tuple[
        bytes, bytes, list[tuple[bytes, bytes]], int, bytes | None, bool, bool, bool, int,
        bytes | None, list[tuple[bytes, bytes]] | None,
] | Literal[False] | None:
    """The head at buf[start:]: None (need more bytes), False (outside the subset: hand the
    bytes to httptools) or (method, target, headers with lower-case names, content_length or
    -1, the authorization value or None (a head with two: False), expect_continue, keep_alive,
    http10, end offset, the traceparent value or None (b"" when given twice), the upstream's
    share of the headers: those not in `drop`)."""
def relay_head(headers: list[tuple[bytes, bytes]], drop: AbstractSet[bytes], t_received: int,
               t_popped: int, t_parsed: int, t_admitted: int, t_sent: int, t_headers: int,
               extra: tuple[tuple[bytes, bytes], ...], /) -> tuple[list[tuple[bytes, bytes]], bool]:
    """headers without the names in drop, then server-timing, then extra; and whether the
    first content-type is text/event-stream (velox.relay.exchange's answer head)."""

@final
class KeyTicket:
    """A keyed request's admission (made by Limits.ticket); each method acts once."""

    def release(self) -> None:
        """Give the gauge's place back (later calls do nothing)."""
    def settle(self, tokens_used: int, /) -> None:
        """Correct the reservation: unused tokens go back, over-use is charged (debt);
        ValueError for tokens_used < 0. Later calls do nothing."""
    @property
    def key(self) -> object: ...
    @property
    def reserved(self) -> int: ...
    @property
    def released(self) -> bool: ...
    @property
    def settled(self) -> bool: ...

# Bookkeeping (native/vx_books.c): the access log's line, the usage and the token estimate.
# The access record's layout (velox.relay.records.ACCESS_FIELDS), as the C reads it.
ACCESS_FIELDS: tuple[str, ...]
def access_line(record: tuple[object, ...] | None, wall_offset_ns: int, worker: int,
                prefix: bytes, seq: int, key_names: tuple[str, ...], priced: bool = False,
                /) -> bytes:
    """One access-log line of a record (velox.relay.records.AccessRecord): the bytes orjson
    makes of the line's dict, newline included (velox.admin.accesslog); `priced`: ending with
    cost_usd."""
def access_lines(items: list[Any], wall_offset_ns: int,
                 worker: int, prefix: bytes, seq: int, key_names: tuple[str, ...], limit: int,
                 priced: bool = False, /) -> tuple[list[bytes], int]:
    """access_line of every record (item i with seq + 1 + i) joined into chunks of whole lines
    of at most `limit` bytes (a longer line alone); items that fail (None) are skipped.
    Returns the chunks and the number of lines."""
class AccessBook:
    """One worker's access-log lines between two flushes, each written by `add` at its
    request's end into one buffer (len: the lines in it); twin: velox.admin.twins.AccessBook."""
    room: int  # bytes the buffer may hold; lines past it are dropped and counted
    wall_offset: int  # wall-clock ns minus perf_counter ns
    key_names: tuple[str, ...]
    @property
    def seq(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def dropped(self) -> int: ...
    def __init__(self, worker: int, prefix: bytes, key_names: tuple[str, ...], priced: bool,
                 room: int) -> None: ...
    def __len__(self) -> int: ...
    def add(self, *fields: Any) -> None:
        """One request's line, its fields in ACCESS_FIELDS' order (request_id: bytes, None or
        the answer's header pairs)."""
    def take(self, limit: int, /) -> tuple[list[tuple[bytes, int]], int]:
        """The lines as chunks of whole lines of at most `limit` bytes with their counts, and
        the lines dropped since the last take; empties the buffer."""
def usage_scan(body: Buffer, /) -> tuple[int, int] | bool:
    """(prompt_tokens, completion_tokens) of the last "usage" in OpenAI's own order; False:
    no "usage" key; True: the last one is in another form."""
def usage_parts_scan(body: Buffer, /) -> tuple[int, int, int, int, int] | bool:
    """(prompt_tokens, completion_tokens, cached_tokens, cache_write_tokens, reasoning_tokens)
    of the last "usage" in OpenAI's own order read whole; False: no "usage" key; True: the last
    one is in another form."""
def estimate_scan(body: Buffer, /) -> tuple[int, int]:
    """(estimated input tokens, max_*tokens or -1) of a request body (velox.relay.usage)."""
