"""The native breakers, in-flight gauges and counters against their Python twin
(velox.state.twins.PyHealth).

Hypothesis drives both with the same generated operations on three upstreams (no cap, cap 1,
cap 2) under generated policies: allow and finish with every outcome, enter and report with
right, stale and made-up probe slots, peek, check, usable_mask, acquire and release, counters, and
a clock that moves by small steps, to 1 ms around the open time's and the probe lease's ends, and
by huge jumps.
Every answer, every breaker read and the drained transitions must be the same.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from velox.state.health import Health
from velox.state.twins import PyHealth

CAPS = (0, 1, 2)
# Mostly one upstream (its breaker then goes through every state), sometimes the others or
# one out of range.
UP = st.one_of(st.just(0), st.integers(0, 2), st.integers(-1, 3))
OUTCOME = st.one_of(st.integers(0, 2), st.integers(0, 2), st.sampled_from([-1, 3]))
TICKET = st.one_of(st.integers(0, 3), st.just(-1))
POLICY = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 50),
                   st.integers(0, 400), st.integers(1, 3), st.integers(1, 80))
# Small steps, the exact edges of the open time and lease (given below as "edge"), huge jumps.
STEP = st.one_of(st.integers(0, 30), st.integers(0, 500), st.just(10**9))

# Macro moves on upstream 0 walk its breaker through every state (a request failing or
# succeeding, a probe entered and never reported, the clock to 1 ms around its due time);
# single calls with any arguments come in between.
MOVES = st.one_of(
    st.tuples(st.just("fail")), st.tuples(st.just("fail")), st.tuples(st.just("ok")),
    st.tuples(st.just("ok")), st.tuples(st.just("lost")), st.tuples(st.just("neutral")),
    st.tuples(st.just("edge"), st.just(0), st.integers(-1, 1)),
    st.tuples(st.just("edge"), st.just(0), st.integers(-1, 1)),
)
OPS = st.one_of(
    MOVES, MOVES, MOVES,
    st.tuples(st.just("allow"), UP),
    st.tuples(st.just("finish"), UP, OUTCOME),  # the probe slot of the last allow there
    st.tuples(st.just("enter"), UP),
    st.tuples(st.just("report"), UP, TICKET, OUTCOME),  # a made-up or last probe slot
    st.tuples(st.just("peek"), UP),
    st.tuples(st.just("check"), UP),
    st.tuples(st.just("usable_mask"), st.lists(UP, max_size=4).map(tuple)),
    st.tuples(st.just("acquire"), UP),
    st.tuples(st.just("release"), UP),
    st.tuples(st.just("count"), UP, st.integers(-1, 6), st.integers(-1, 3)),
    st.tuples(st.just("counter"), UP, st.integers(-1, 6)),
    st.tuples(st.just("breaker"), UP),
)
MACROS = {"fail": [("allow", 0), ("finish", 0, 1)], "ok": [("allow", 0), ("finish", 0, 0)],
          "neutral": [("allow", 0), ("finish", 0, 2)], "lost": [("enter", 0)]}
TIMED = {"allow", "finish", "enter", "report", "peek", "check", "usable_mask", "breaker"}


def outcome(call: Any) -> Any:
    try:
        return ("value", call())
    except (IndexError, ValueError, TypeError, OverflowError) as exc:
        return ("raised", type(exc))


def _prepare(name: str, args: list[Any], now: int, native: Any, twin: PyHealth, lease: int,
             probe_slots: dict[int, int]) -> tuple[str, list[Any], int]:
    """A step's call: "edge" moves the clock to just around when upstream's breaker changes
    (and peeks); finish takes the last probe slot its upstream gave, report it when asked (3)."""
    if name == "edge":
        state = native.breaker(args[0] % 3, now)
        due = state[4] + (twin.open_time(state[3]) if state[0] == 1 else lease)
        return "peek", [args[0]], max(now, due + args[1])
    if name == "finish":
        return name, [args[0], probe_slots.get(args[0], 0), args[1]], now
    if name == "report" and args[1] == 3:  # the last real probe slot, else a made-up one
        return name, [args[0], probe_slots.get(args[0], 0), args[2]], now
    return name, args, now


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(POLICY, st.lists(st.tuples(OPS, STEP), min_size=10, max_size=100))
def test_health_does_what_its_twin_does(policy: tuple[int, ...],
                                        steps: list[tuple[tuple[Any, ...], int]]) -> None:
    failures, successes, open_ms, extra, probes, lease = policy
    shape = (CAPS, failures, successes, open_ms, open_ms + extra, probes, lease)
    native, twin = Health(*shape), PyHealth(*shape)
    now = 1_000
    probe_slots: dict[int, int] = {}  # the last probe slot each upstream gave (native's = twin's)
    calls = [(call, step if k == 0 else 0) for op, step in steps
             for k, call in enumerate(MACROS.get(op[0], [op]))]
    for (op, *raw), step in calls:
        name, args, now = _prepare(op, raw, now + step, native, twin, lease, probe_slots)
        call_args = (*args, now) if name in TIMED else tuple(args)
        got = outcome(lambda: getattr(native, name)(*call_args))
        want = outcome(lambda: getattr(twin, name)(*call_args))
        assert got == want, (name, call_args)
        if name in ("allow", "enter") and got[0] == "value" and got[1] >= 0:
            probe_slots[args[0]] = got[1]
        assert native.transitions() == twin.transitions(), (name, call_args)
    for u in range(len(CAPS)):
        assert native.breaker(u, now) == twin.breaker(u, now)
        assert native.in_flight(u) == twin.in_flight(u)
    for late in (now + (1 << 40), -1):  # outside the clock's range: refused alike
        assert outcome(lambda: native.peek(0, late)) == outcome(lambda: twin.peek(0, late))


def test_policies_out_of_bounds_are_refused_alike() -> None:
    for shape in (((), 1, 1, 1, 1, 1, 1), ((1,), 0, 1, 1, 1, 1, 1), ((1,), 1, 256, 1, 1, 1, 1),
                  ((1,), 1, 1, 5, 4, 1, 1), ((1,), 1, 1, 1, 1, 64, 1), ((-1,), 1, 1, 1, 1, 1, 1),
                  ((1,), 1, 1, 1, 1 << 31, 63, 1 << 31)):
        assert outcome(lambda: len(Health(*shape))) == outcome(lambda: len(PyHealth(*shape)))
