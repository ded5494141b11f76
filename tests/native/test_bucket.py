"""velox_lab._bucket.TokenBucket (the lone bucket, outside the product): bad input, exact
integer refill, clock going backwards, and exactness under contention from threads (GIL
released) and from forked processes.

The exactness bounds, in integer units (1 token = 60,000,000 units = microseconds per
minute, so a rate of r tokens per minute adds exactly r units per microsecond):

* upper, no slack: admitted * U <= burst * U + rate * (t_end - t_start), where t_start is
  read before the bucket is created (its refill clock starts at creation) and t_end after
  the last acquire has returned;
* lower: admitted + left + 1 > burst + rate * (t_end - t_created) / U, where `left` is
  `available()` read after t_end (whole tokens still in the bucket, refill pending since
  the last refill included) and the 1 is the fraction of a token `available()` rounds
  away. It holds exactly as long as no credit was discarded at the cap, which the tests
  guarantee: they drain the bucket right after creating it, the burst covers more than a
  second of refill, and the hammering keeps it near empty.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable

import pytest

from velox_lab._bucket import TokenBucket

U = 60_000_000  # units per token
MAX = 10**9


def now_us() -> int:
    return time.monotonic_ns() // 1000


def fresh_at(rate: int, burst: int) -> tuple[TokenBucket, int]:
    """A bucket that is empty with its refill clock at exactly `base` (a time well ahead of
    the real clock, so explicit-clock calls are deterministic)."""
    bucket = TokenBucket(rate, burst)
    base = now_us() + 10**9
    # Starts full. A take that finds it full stamps the refill clock to `base`: the bucket
    # was full until then, so none of that time may be credited later.
    assert bucket._acquire_at(burst, base)
    assert bucket._acquire_up_to_at(burst, base) == 0
    assert bucket._acquire_at(1, base) is False
    return bucket, base


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [0, -1, -(2**70), MAX + 1, 2**64, 2**100])
def test_bad_rate_is_value_error_naming_argument(bad: int) -> None:
    with pytest.raises(ValueError) as info:
        TokenBucket(bad, 10)
    assert "rate_per_minute" in str(info.value)
    assert str(bad) in str(info.value)


@pytest.mark.parametrize("bad", [0, -1, -(2**70), MAX + 1, 2**64])
def test_bad_burst_is_value_error_naming_argument(bad: int) -> None:
    with pytest.raises(ValueError) as info:
        TokenBucket(10, bad)
    assert "burst" in str(info.value)
    assert str(bad) in str(info.value)


def test_wrong_types() -> None:
    with pytest.raises(TypeError):
        TokenBucket(1.5, 10)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TokenBucket(10)  # type: ignore[call-arg]
    bucket = TokenBucket(10, 10)
    with pytest.raises(TypeError):
        bucket.acquire("1")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        bucket.acquire(1, 2)  # type: ignore[call-arg]


def test_limits_are_accepted_and_reported() -> None:
    bucket = TokenBucket(rate_per_minute=MAX, burst=MAX)
    assert bucket.rate_per_minute == MAX
    assert bucket.burst == MAX
    assert bucket.available() == MAX


def test_n_above_burst_and_below_one() -> None:
    bucket = TokenBucket(1, 5)
    assert bucket.acquire(6) is False
    assert bucket.acquire(2**80) is False  # huge: "more than burst", not OverflowError
    assert bucket.wait_hint_us(6) == -1
    assert bucket.wait_hint_us(2**80) == -1
    assert bucket.acquire_up_to(0) == 0  # min(0, available)
    for bad in (0, -1, -(2**80)):
        with pytest.raises(ValueError):
            bucket.acquire(bad)
        if bad < 0:
            with pytest.raises(ValueError):
                bucket.acquire_up_to(bad)
        with pytest.raises(ValueError):
            bucket.wait_hint_us(bad)
        with pytest.raises(ValueError):
            bucket._acquire_at(bad, now_us())
    assert bucket.available() == 5  # nothing was taken by any of that
    assert bucket.acquire_up_to(2**80) == 5  # clamped to burst


# ---------------------------------------------------------------- semantics


def test_starts_full_and_does_not_overdraw() -> None:
    bucket = TokenBucket(1, 10)  # one token a minute: nothing refills during this test
    assert bucket.available() == 10
    assert bucket.wait_hint_us(10) == 0
    assert bucket.acquire()
    assert bucket.acquire(3)
    assert bucket.available() == 6
    assert bucket.acquire(7) is False  # all or nothing
    assert bucket.available() == 6
    assert bucket.acquire_up_to(4) == 4
    assert bucket.acquire_up_to(4) == 2
    assert bucket.acquire_up_to(4) == 0
    assert bucket.acquire() is False
    hint = bucket.wait_hint_us()
    assert 0 < hint <= 60_000_000


def test_refill_is_exact_to_the_microsecond() -> None:
    bucket, base = fresh_at(60, 10)  # one token per second
    assert bucket._acquire_at(1, base + 999_999) is False  # 60 units short
    assert bucket._acquire_at(1, base + 1_000_000) is True  # the remainder was kept
    assert bucket._acquire_at(1, base + 1_000_000) is False
    # 3.5 s later: three whole tokens and half of the fourth.
    assert bucket._acquire_up_to_at(10, base + 4_500_000) == 3
    assert bucket._acquire_at(1, base + 4_999_999) is False
    assert bucket._acquire_at(1, base + 5_000_000) is True


def test_refill_caps_at_burst() -> None:
    bucket, base = fresh_at(60, 10)
    hour = 3_600_000_000
    assert bucket._acquire_up_to_at(1000, base + hour) == 10
    assert bucket._acquire_up_to_at(1000, base + hour) == 0


def test_a_quiet_period_is_not_credited_twice() -> None:
    """Full and idle for an hour, then a rush: one burst, then the rate (not two bursts)."""
    bucket = TokenBucket(60, 10)
    later = now_us() + 3_600_000_000
    assert sum(bucket._acquire_at(1, later) for _ in range(25)) == 10
    assert bucket._acquire_at(1, later + 999_999) is False
    assert bucket._acquire_at(1, later + 1_000_000) is True


def test_batch_take_after_a_partly_drained_quiet_period_is_one_burst() -> None:
    """acquire_up_to refills before it takes, so the window after idling holds one burst."""
    bucket = TokenBucket(60, 10)
    start = now_us() + 10**9
    assert bucket._acquire_up_to_at(4, start) == 4
    later = start + 3_600_000_000
    assert sum(bucket._acquire_up_to_at(7, later) for _ in range(5)) == 10
    assert bucket._acquire_up_to_at(7, later + 2_000_000) == 2


def test_clock_going_backwards_never_mints() -> None:
    bucket, base = fresh_at(60, 10)
    for back in (base - 1, base - 5_000_000, 0, -(2**63)):
        assert bucket._acquire_at(1, back) is False
        assert bucket._acquire_up_to_at(5, back) == 0
    # Credit still runs from base, not from any earlier reading.
    assert bucket._acquire_at(1, base + 999_999) is False
    assert bucket._acquire_at(1, base + 1_000_000) is True
    # A backward jump after that does not re-credit the same second.
    assert bucket._acquire_at(1, base + 500_000) is False
    assert bucket._acquire_at(1, base + 1_000_000) is False
    assert bucket._acquire_at(1, base + 2_000_000) is True


def test_wait_hint_matches_real_refill_time() -> None:
    bucket = TokenBucket(60_000, 1)  # one token per millisecond
    assert bucket.wait_hint_us() == 0
    assert bucket.acquire()
    hint = bucket.wait_hint_us()
    assert 0 <= hint <= 1000
    assert TokenBucket(60_000, 5).wait_hint_us(6) == -1


def test_shared_with_forked_child() -> None:
    ctx = multiprocessing.get_context("fork")
    bucket = TokenBucket(1, 100)
    child = ctx.Process(target=bucket.acquire, args=(40,))
    try:
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert bucket.available() == 60  # the child's withdrawal is visible in the parent


# ---------------------------------------------------------------- exactness under contention

RATE = 600_000  # tokens per minute = 10 per millisecond
BURST = 20_000  # 2 s of refill: no credit is discarded at the cap during the test
HAMMER_US = 400_000


def check_bounds(admitted: int, left: int, t_start: int, t_created: int, t_end: int) -> None:
    upper = BURST * U + RATE * (t_end - t_start)
    assert admitted * U <= upper, (admitted, upper / U)
    lower = BURST * U + RATE * (t_end - t_created)
    assert (admitted + left + 1) * U > lower, (admitted, left, lower / U)
    # The rate part must really have been exercised, not just the initial burst.
    assert admitted > BURST + RATE * HAMMER_US // 2 // 60_000_000


def test_exact_under_four_threads_without_gil() -> None:
    t_start = now_us()
    bucket = TokenBucket(RATE, BURST)
    # Drain it now: from here on it sits far below its cap, so no credit is ever discarded
    # there (a refill of a nearly full bucket would discard some, and the lower bound would
    # not hold); acquire_up_to refilled first, so the lower bound counts from here.
    assert bucket.acquire_up_to(BURST) == BURST
    t_created = now_us()
    results = [BURST, 0, 0, 0, 0]

    def run(i: int) -> None:
        results[i] = bucket._hammer(HAMMER_US, 1 + i % 2)  # mixed demand: 1 and 2 tokens

    threads = [threading.Thread(target=run, args=(i + 1,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    t_end = now_us()
    left = bucket.available()
    check_bounds(sum(results), left, t_start, t_created, t_end)


def _hammer_python(bucket: TokenBucket, duration_us: int, conn: object) -> None:
    """Child body: a Python-level loop mixing acquire and acquire_up_to."""
    admitted = 0
    deadline = time.monotonic_ns() // 1000 + duration_us
    while time.monotonic_ns() // 1000 < deadline:
        if bucket.acquire():
            admitted += 1
        admitted += bucket.acquire_up_to(3)
    conn.send(admitted)  # type: ignore[attr-defined]


def _hammer_native(bucket: TokenBucket, duration_us: int, conn: object) -> None:
    conn.send(bucket._hammer(duration_us, 1))  # type: ignore[attr-defined]


def test_exact_across_forked_processes() -> None:
    ctx = multiprocessing.get_context("fork")
    t_start = now_us()
    bucket = TokenBucket(RATE, BURST)
    # Drained before the children start (see the thread test): forking takes milliseconds,
    # and a child's first refill of a still-full bucket would discard their credit.
    assert bucket.acquire_up_to(BURST) == BURST
    t_created = now_us()
    bodies: list[Callable[[TokenBucket, int, object], None]] = [
        _hammer_native,
        _hammer_python,
        _hammer_native,
    ]
    pipes = [ctx.Pipe(duplex=False) for _ in bodies]
    procs = [
        ctx.Process(target=body, args=(bucket, HAMMER_US, send))
        for body, (_, send) in zip(bodies, pipes, strict=False)
    ]
    try:
        for p in procs:
            p.start()
        counts = []
        for recv, _ in pipes:
            assert recv.poll(60), "a hammering child did not report"
            counts.append(recv.recv())
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    t_end = now_us()
    left = bucket.available()
    check_bounds(BURST + sum(counts), left, t_start, t_created, t_end)
