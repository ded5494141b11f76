"""Private native core of Velox (C extension `velox._native`).

Do not import this module directly: the public faces are velox.ring, velox.ratelimit,
velox.stats and velox.health. Errors: ValueError for bad values (integers too large for int64
included, never OverflowError), TypeError for wrong types, IndexError for slot/field out of
range.
"""

from collections.abc import Sequence
from typing import Final, final

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
class TokenBucket:
    """Lock-free integer token bucket in an anonymous shared mapping.

    Starts full. A bucket created before fork() is one bucket for the parent and every
    child. Refill is lazy (credited when a take comes up short), integer-only, with
    microsecond precision.
    """

    def __init__(self, rate_per_minute: int, burst: int) -> None:
        """Both in [1, 10**9]; otherwise ValueError naming the argument."""
    def acquire(self, n: int = 1, /) -> bool:
        """Take n tokens at once or none. n > burst: False at once. n < 1: ValueError."""
    def acquire_up_to(self, n: int, /) -> int:
        """Take min(n, whole tokens available); return how many (0 for n == 0).

        n < 0: ValueError. Huge n is clamped to burst."""
    def wait_hint_us(self, n: int = 1, /) -> int:
        """Microseconds until n tokens can be available: 0 if now, -1 if n > burst."""
    def available(self) -> int:
        """Whole tokens available now, pending refill included (approximate; for metrics)."""
    @property
    def rate_per_minute(self) -> int: ...
    @property
    def burst(self) -> int: ...
    # Test hooks, not API: explicit clocks and a GIL-free hammer for exactness tests.
    def _acquire_at(self, n: int, now_us: int, /) -> bool:
        """Test hook: acquire(n) with an explicit CLOCK_MONOTONIC time in microseconds."""
    def _acquire_up_to_at(self, n: int, now_us: int, /) -> int:
        """Test hook: acquire_up_to(n) with an explicit clock."""
    def _hammer(self, duration_us: int, n: int, /) -> int:
        """Test hook: with the GIL released, call acquire(n) in a tight loop for duration_us
        (at most 60 s); return the number of tokens admitted."""

@final
class Counters:
    """slots x fields int64 counters in an anonymous shared mapping (shared across fork).

    Each slot's row starts on its own 64-byte cache line; one slot per worker process.
    """

    def __init__(self, slots: int, fields: int) -> None:
        """slots in [1, 4096], fields in [1, 4096]; otherwise ValueError."""
    def add(self, slot: int, field: int, n: int = 1, /) -> None:
        """Relaxed atomic fetch_add. IndexError on a bad slot or field."""
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

# Shared per-upstream health (vx_health). The public face is velox.health.
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
    def admit(self, upstream: int, now_ms: int | None, /) -> int:
        """enter() + acquire() + count(UP_REQUESTS): a ticket >= 0, or -1 (breaker refuses) /
        -2 (max_in_flight reached), having taken nothing."""
    def finish(self, upstream: int, ticket: int, outcome: int, now_ms: int | None, /) -> None:
        """release() + report() + count UP_SUCCESSES / UP_FAILURES."""
    def enter(self, upstream: int, now_ms: int | None = None, /) -> int:
        """-1 refused, 0 admitted (closed), > 0 a probe ticket; tickets >= 0 go to report()."""
    def report(self, upstream: int, ticket: int, outcome: int, now_ms: int | None = None, /) -> int:
        """Outcome (OUTCOME_*) of a request admitted with ticket; returns the TR_* it caused."""
    def breaker(
        self, upstream: int, now_ms: int | None = None, /
    ) -> tuple[int, int, int, int, int, int, int, int]:
        """(state, count, probes, streak, stamp_ms, opened_at_ms, open_count,
        until_half_open_ms) from one read of the breaker word."""
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

# HTTP/1.1 response writer (native/vx_http1.c); the face is velox.h1write.
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
