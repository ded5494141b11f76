"""velox._native.Limits: bad input, bucket semantics (exact refill, debt, leased buckets,
reconfiguration), gauges with per-slot rows and forget_slot, sharing across fork, and
exactness under contention from threads (GIL released) and forked processes.

Exactness bound (integer units, 1 token = 60,000,000 units, a rate of r tokens per minute
adds r units per microsecond): every take refills first, so over a run starting with the
bucket drained at t_created,
    upper, no slack:  admitted * U <= burst_left_at_start * U + rate * (t_end - t_start)
    lower:            admitted + left + 1 > rate * (t_end - t_created) / U
where `left` is level() after t_end (pending refill included) and the 1 the fraction of a
token level() rounds away. The lower bound holds because the bucket stays far below its cap
(no credit discarded) and a take is refused only when the level is really short.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from velox._native import LIMITS_LEASE_WAIT_US, LIMITS_NEVER, Limits

U = 60_000_000
MAX = 10**9


def now_us() -> int:
    return time.monotonic_ns() // 1000


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [0, -1, 10**6 + 1, 2**70])
def test_bad_n_is_value_error_naming_it(bad: int) -> None:
    with pytest.raises(ValueError) as info:
        Limits(bad)
    assert "n must be" in str(info.value) and str(bad) in str(info.value)


@pytest.mark.parametrize("bad", [0, -3, 4097])
def test_bad_slots_is_value_error_naming_it(bad: int) -> None:
    with pytest.raises(ValueError) as info:
        Limits(1, slots=bad)
    assert "slots" in str(info.value) and str(bad) in str(info.value)


def test_bad_arguments_of_every_method() -> None:
    lim = Limits(2, slots=2)
    assert len(lim) == 2 and lim.slots == 2
    for call in (
        lambda: lim.configure(2, 1, 1),
        lambda: lim.take(-1, 1),
        lambda: lim.give(5, 1),
        lambda: lim.level(2),
        lambda: lim.taken(2),
        lambda: lim.config(2),
        lambda: lim.active(2),
        lambda: lim.enter(0, 1, 2),  # slot
        lambda: lim.leave(0, -1),
        lambda: lim.held(0, 9),
        lambda: lim.forget_slot(2),
    ):
        with pytest.raises(IndexError):
            call()
    with pytest.raises(ValueError, match="rate_per_minute"):
        lim.configure(0, -1, 10)
    with pytest.raises(ValueError, match="rate_per_minute"):
        lim.configure(0, MAX + 1, 10)
    with pytest.raises(ValueError, match="burst"):
        lim.configure(0, 60, 0)
    with pytest.raises(ValueError, match="burst"):
        lim.configure(0, 60, MAX + 1)
    assert lim.config(0) == (0, 0)  # nothing was applied
    lim.configure(0, 60, 10)
    for bad in (0, -1, -(2**80)):
        with pytest.raises(ValueError):
            lim.take(0, bad)
    for bad in (-1, -(2**80)):
        for method in (lim.give, lim.refund, lim.charge):
            with pytest.raises(ValueError):
                method(0, bad)
    with pytest.raises(TypeError):
        lim.take(0, 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        lim.take(0)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Limits("3")  # type: ignore[arg-type]
    assert lim.take(0, 2**80) == LIMITS_NEVER  # huge: more than burst, not OverflowError
    assert lim.level(0) == 10 and lim.taken(0) == 0  # nothing taken by any of that


# ---------------------------------------------------------------- buckets


def test_unconfigured_entry_refuses_everything() -> None:
    lim = Limits(3)
    assert lim.config(1) == (0, 0)
    assert lim.take(1, 1) == LIMITS_NEVER == -1
    assert lim.give(1, 5) == 0
    assert lim.level(1) == 0


def test_refill_is_exact_to_the_microsecond() -> None:
    lim = Limits(1)
    base = now_us() + 10**9  # ahead of the real clock: explicit-clock calls are deterministic
    lim.configure(0, 60, 10, base)  # one token per second; starts full
    assert lim.take(0, 10, base) == 0
    assert lim.take(0, 1, base) == 1_000_000
    assert lim.take(0, 1, base + 999_999) == 1  # 60 units short
    assert lim.take(0, 1, base + 1_000_000) == 0  # the remainder was kept
    assert lim.level(0, base + 4_500_000) == 3
    assert lim.take(0, 4, base + 4_500_000) == 500_000
    assert lim.level(0, base + 3600 * 10**6) == 10  # capped at burst
    assert lim.take(0, 11, base) == LIMITS_NEVER
    assert lim.taken(0) == 11


def test_debt_refuses_until_repaid_and_refund_lowers_taken() -> None:
    lim = Limits(1)
    base = now_us() + 10**9
    lim.configure(0, 600, 100, base)  # 10 tokens per second
    assert lim.take(0, 40, base) == 0  # a reservation of 40
    lim.charge(0, 100)  # the answer used 140
    assert lim.level(0, base) == -40 and lim.taken(0) == 140
    assert lim.take(0, 1, base) == 4_100_000  # 41 tokens to refill first
    assert lim.take(0, 1, base + 4_100_000) == 0
    assert lim.take(0, 5, base + 4_100_000 + 500_000) == 0  # 5 reserved...
    assert lim.refund(0, 3) == 3  # ...2 used
    assert lim.taken(0) == 143
    assert lim.level(0, base + 4_600_000) == 3
    lim.charge(0, 0)  # a no-op, allowed (settling an exact reservation)
    assert lim.refund(0, 0) == 0 and lim.give(0, 0) == 0


def test_leased_bucket_fills_only_by_give() -> None:
    lim = Limits(1)
    base = now_us() + 10**9
    lim.configure(0, 0, 50, base)
    assert lim.config(0) == (0, 50)
    assert lim.level(0, base + 3600 * 10**6) == 0  # no clock refill, starts empty
    assert lim.take(0, 1, base) == LIMITS_LEASE_WAIT_US
    assert lim.give(0, 30) == 30
    assert lim.take(0, 20, base + 10**9) == 0
    assert lim.give(0, 100) == 40  # capped at burst
    assert lim.taken(0) == 20
    # Back to a clock rate: the time spent leased is not credited, the level is kept.
    lim.configure(0, 60, 50, base + 7200 * 10**6)
    assert lim.level(0, base + 7200 * 10**6) == 50
    assert lim.take(0, 50, base + 7200 * 10**6) == 0
    assert lim.level(0, base + 7202 * 10**6) == 2


def test_reconfigure_keeps_level_capped_at_new_burst() -> None:
    lim = Limits(1)
    base = now_us() + 10**9
    lim.configure(0, 60, 100, base)
    assert lim.take(0, 90, base) == 0
    lim.configure(0, 60, 5, base + 2_000_000)  # 10 + 2 s of the old rate, capped at 5
    assert lim.level(0, base + 2_000_000) == 5
    lim.configure(0, 6000, 1000, base + 2_000_000)  # a larger burst does not fill it
    assert lim.level(0, base + 2_000_000) == 5
    assert lim.level(0, base + 3_000_000) == 105


# ---------------------------------------------------------------- gauges


def test_gauge_limit_holds_across_slots_and_leave_is_idempotent() -> None:
    lim = Limits(4, slots=3)
    assert lim.enter(2, 2, 0) and lim.enter(2, 2, 1)
    assert lim.enter(2, 2, 2) is False
    assert lim.active(2) == 2 and lim.held(2, 0) == 1 and lim.held(2, 2) == 0
    assert lim.leave(2, 0) is True
    assert lim.leave(2, 0) is False  # a second leave changes nothing
    assert lim.leave(2, 2) is False  # a slot that holds nothing
    assert lim.active(2) == 1
    for _ in range(5):
        assert lim.enter(3, 0, 1)  # limit 0: counts only
    assert lim.active(3) == 5
    assert lim.forget_slot(1) == 6  # one place of gauge 2, five of gauge 3
    assert lim.active(2) == 0 and lim.active(3) == 0
    assert lim.forget_slot(1) == 0


def test_shared_with_forked_child_and_forget_slot_after_sigkill() -> None:
    lim = Limits(2, slots=2)
    lim.configure(0, 1, 100)
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()

    def child() -> None:
        assert lim.take(0, 40) == 0
        for _ in range(3):
            lim.enter(1, 5, 1)
        ready.set()
        time.sleep(60)  # killed long before

    proc = ctx.Process(target=child)
    proc.start()
    try:
        assert ready.wait(30)
        assert lim.level(0) == 60  # the child's take is visible here
        assert lim.active(1) == 3 and lim.held(1, 1) == 3
        assert lim.enter(1, 5, 0) and lim.enter(1, 5, 0)
        assert lim.enter(1, 5, 0) is False  # the dead-to-be child holds 3 of 5
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        assert lim.active(1) == 5  # nothing gives them back by itself...
        assert lim.forget_slot(1) == 3  # ...the supervisor does
        assert lim.active(1) == 2 and lim.held(1, 0) == 2
        assert lim.enter(1, 5, 0)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


# ---------------------------------------------------------------- exactness under contention

RATE = 600_000  # 10 tokens per millisecond
BURST = 20_000  # 2 s of refill: the hammering keeps the bucket far below it
HAMMER_US = 400_000


def check_bounds(admitted: int, left: int, t_start: int, t_created: int, t_end: int) -> None:
    upper = RATE * (t_end - t_start)  # drained at creation: the burst is not in play
    assert admitted * U <= upper, (admitted, upper / U)
    lower = RATE * (t_end - t_created)
    assert (admitted + left + 1) * U > lower, (admitted, left, lower / U)
    assert admitted > RATE * HAMMER_US // 2 // 60_000_000  # the rate really was exercised


def fresh() -> tuple[Limits, int, int]:
    t_start = now_us()
    lim = Limits(1)
    lim.configure(0, RATE, BURST)
    assert lim.take(0, BURST) == 0  # drained: no credit will be discarded at the cap
    return lim, t_start, now_us()


def test_exact_under_four_threads_without_gil() -> None:
    lim, t_start, t_created = fresh()
    results = [0, 0, 0, 0]

    def run(i: int) -> None:
        results[i] = lim._hammer(0, HAMMER_US, 1 + i % 2)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    t_end = now_us()
    check_bounds(sum(results), lim.level(0), t_start, t_created, t_end)
    assert lim.taken(0) == BURST + sum(results)


def _hammer_python(lim: Limits, conn: object) -> None:
    admitted = 0
    deadline = now_us() + HAMMER_US
    while now_us() < deadline:
        if lim.take(0, 2) == 0:
            admitted += 2
    conn.send(admitted)  # type: ignore[attr-defined]


def _hammer_native(lim: Limits, conn: object) -> None:
    conn.send(lim._hammer(0, HAMMER_US, 1))  # type: ignore[attr-defined]


def test_exact_across_forked_processes() -> None:
    ctx = multiprocessing.get_context("fork")
    lim, t_start, t_created = fresh()
    pipes = [ctx.Pipe(duplex=False) for _ in range(3)]
    bodies = [_hammer_native, _hammer_python, _hammer_native]
    procs = [ctx.Process(target=b, args=(lim, send)) for b, (_, send) in zip(bodies, pipes,
                                                                             strict=False)]
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
    check_bounds(sum(counts), lim.level(0), t_start, t_created, t_end)


# ---------------------------------------------------------------- admit (one call per request)


def test_admit_is_all_or_nothing() -> None:
    # The results are read through the façade's named decoding (velox.state.limits), so this
    # also checks that its layout matches what the C binding packs.
    from velox.state.limits import Admit, refusal, remaining

    lim = Limits(2, slots=2)
    base = now_us() + 10**9
    lim.configure(0, 60, 2, base)  # requests: 2, one a second
    lim.configure(1, 600, 100, base)  # tokens: 100, ten a second
    code = lim.admit(0, 1, 60, 0, 1, 1, base)
    assert code < 0 and remaining(code) == (1, 40)  # admitted: 1 request and 40 tokens left
    assert lim.active(0) == 1 and lim.held(0, 1) == 1 and lim.entered(0) == 1
    code = lim.admit(0, 1, 60, 0, 0, 1, base)  # 40 tokens left, 60 asked
    assert refusal(code) == (Admit.TOKENS, 2_000_000)
    assert lim.level(0, base) == 1 and lim.level(1, base) == 40  # the request came back
    code = lim.admit(0, 1, 30, 0, 1, 0, base)  # the gauge's one place is held
    assert refusal(code) == (Admit.PARALLEL, 1_000_000)
    assert lim.level(0, base) == 1 and lim.level(1, base) == 40 and lim.active(0) == 1
    assert remaining(lim.admit(0, -1, 0, -1, 0, 0, base)) == (0, 0)  # the last request
    code = lim.admit(0, 1, 1, 0, 0, 0, base)
    assert refusal(code) == (Admit.REQUESTS, 1_000_000)
    assert refusal(lim.admit(-1, 1, 101, -1, 0, 0, base)) == (Admit.TOKENS, 0)  # never
    code = lim.admit(-1, -1, 5, -1, 0, 0, base)
    assert code < 0 and remaining(code) == (0, 0)  # every step skipped
    assert lim.entered(0) == 1  # refused admissions entered nothing
    for bad_index in ((2, 1), (-2, 1), (0, 2), (0, -2)):
        with pytest.raises(IndexError):
            lim.admit(bad_index[0], bad_index[1], 1, 0, 0, 0)
    with pytest.raises(IndexError):
        lim.admit(0, 1, 1, 0, 0, 2)  # slot
    with pytest.raises(ValueError, match="tokens"):
        lim.admit(0, 1, -1, 0, 0, 0)
    assert lim.taken(0) == 2 and lim.taken(1) == 60  # refused admissions took nothing


def test_admit_results_decode_at_their_bounds() -> None:
    from velox.state.limits import Admit, refusal, remaining

    big = 10**9  # the largest rate and burst: both halves of an admitted result at their widest
    lim = Limits(2)
    base = now_us() + 10**9
    lim.configure(0, big, big, base)
    lim.configure(1, big, big, base)
    assert remaining(lim.admit(0, 1, 7, -1, 0, 0, base)) == (big - 1, big - 7)
    lim.configure(0, 1, 1, base)  # one request a minute: the next waits a whole minute
    lim.admit(0, -1, 0, -1, 0, 0, base)
    assert refusal(lim.admit(0, -1, 0, -1, 0, 0, base)) == (Admit.REQUESTS, 60_000_000)
