"""The native shared limits (token buckets and gauges) against their Python twin
(velox.state.twins.PyLimits).

Hypothesis drives both with the same generated operations on a few entries and slots: configure
(leased and clock-refilled, reconfigured up and down), take, give, refund, charge into debt,
level, enter and leave against limits, forget_slot, admit with skipped steps, indexes and
amounts out of range, and a clock that mostly moves forward by small and huge steps and
sometimes goes back. Every answer must be the same value or the same exception type, and the
counters (taken, refused, largest, active, held, entered) the same after every step.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from velox.state.limits import Limits
from velox.state.twins import PyLimits

N, SLOTS = 3, 2
# Mostly valid; -1 and N out of range (or "skip", for admit) now and then.
INDEX = st.one_of(st.integers(0, N - 1), st.integers(0, N - 1), st.integers(-1, N))
SLOT = st.one_of(st.integers(0, SLOTS - 1), st.integers(-1, SLOTS))
AMOUNT = st.one_of(st.integers(0, 12), st.integers(-2, 40),
                   st.sampled_from([10**9, 10**10, 10**11, 1 << 70]))
RATE = st.one_of(st.integers(0, 600), st.integers(1, 10**7), st.sampled_from([10**9, 60, 1]))
BURST = st.one_of(st.integers(1, 30), st.sampled_from([10**9, 0, 10**9 + 1]))
STEP = st.one_of(st.integers(0, 2_000_000), st.integers(0, 2_000),
                 st.sampled_from([10**12, -5_000, 1]))

OPS = st.one_of(
    st.tuples(st.just("configure"), INDEX, RATE, BURST),
    st.tuples(st.just("take"), INDEX, AMOUNT),
    st.tuples(st.just("give"), INDEX, AMOUNT),
    st.tuples(st.just("refund"), INDEX, AMOUNT),
    st.tuples(st.just("charge"), INDEX, AMOUNT),
    st.tuples(st.just("level"), INDEX),
    st.tuples(st.just("pop_largest"), INDEX),
    st.tuples(st.just("enter"), INDEX, st.integers(-1, 3), SLOT),
    st.tuples(st.just("leave"), INDEX, SLOT),
    st.tuples(st.just("forget_slot"), SLOT),
    st.tuples(st.just("admit"), INDEX, INDEX, AMOUNT, INDEX, st.integers(-1, 3), SLOT),
    st.tuples(st.just("config"), INDEX),
)
TIMED = {"configure", "take", "level", "admit"}  # the calls that take now_us


def outcome(call: Any) -> Any:
    try:
        return ("value", call())
    except (IndexError, ValueError, TypeError, OverflowError) as exc:
        return ("raised", type(exc))


def state(limits: Any) -> list[Any]:
    return [(limits.taken(i), limits.refused(i), limits.active(i), limits.entered(i),
             [limits.held(i, s) for s in range(SLOTS)]) for i in range(N)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(RATE, BURST), min_size=N, max_size=N),
       st.lists(st.tuples(OPS, STEP), max_size=60))
def test_limits_do_what_their_twin_does(configs: list[tuple[int, int]],
                                        steps: list[tuple[tuple[Any, ...], int]]) -> None:
    native, twin = Limits(N, SLOTS), PyLimits(N, SLOTS)
    now = 10**9
    first = [(("configure", i, rate, burst), 0) for i, (rate, burst) in enumerate(configs)]
    for (name, *args), step in first + steps:
        now += step
        call_args = (*args, now) if name in TIMED else tuple(args)
        got = outcome(lambda: getattr(native, name)(*call_args))
        want = outcome(lambda: getattr(twin, name)(*call_args))
        assert got == want, (name, call_args)
        assert state(native) == state(twin), (name, call_args)
    for i in range(N):
        assert native.level(i, now) == twin.level(i, now)
        assert native.pop_largest(i) == twin.pop_largest(i)


def test_refusals_are_the_same_for_bad_shapes() -> None:
    for n, slots in ((0, 1), (1, 0), (10**6 + 1, 1), (1, 4097), (2, 3)):
        assert outcome(lambda: len(Limits(n, slots))) == \
            outcome(lambda: len(PyLimits(n, slots)))
