"""The native shared counters and histograms against their Python twins (velox.state.twins).

Hypothesis drives both with the same generated operations, valid and not (slots and fields
out of range, values outside int64, quantiles outside (0, 1]), and every read must agree: the
same numbers, or the same exception type. The twins state in a few lines what the C does
(int64 wrap-around, add_many's all-or-nothing check, the log-linear buckets and nearest-rank
percentiles), so a change to either side that the other does not share fails here.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from velox.state.stats import Counters, Histogram
from velox.state.twins import (
    BUCKETS,
    EXACT,
    MAX_US,
    PyCounters,
    PyHistogram,
    bucket_index,
    bucket_lower,
    bucket_upper,
)

INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
# Mostly in range, sometimes just outside: the edges are where the two could differ.
WIDE = st.one_of(INT64, st.integers(-(1 << 64), 1 << 64), st.sampled_from(
    [(1 << 63) - 1, -(1 << 63), 1 << 63, -(1 << 63) - 1, 0, 1, -1]))


def outcome(call: Any) -> Any:
    """What a call gave: its value, or the type of what it raised."""
    try:
        return ("value", call())
    except (IndexError, ValueError, TypeError, OverflowError) as exc:
        return ("raised", type(exc))


def counter_ops(slots: int, fields: int) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    slot = st.integers(-1, slots)
    field = st.integers(-1, fields)
    one = st.one_of(
        st.tuples(st.just("add"), slot, field, WIDE),
        st.tuples(st.just("add1"), slot, field),
        st.tuples(st.just("set"), slot, field, WIDE),
        st.tuples(st.just("get"), slot, field),
        st.tuples(st.just("add_many"), slot,
                  st.lists(st.tuples(field, WIDE), min_size=0, max_size=17)),
        st.tuples(st.just("totals")),
        st.tuples(st.just("snapshot")),
    )
    return st.lists(one, max_size=60)


def apply_counters(table: Any, op: tuple[Any, ...]) -> Any:
    name, *args = op
    if name == "add":
        return outcome(lambda: table.add(*args))
    if name == "add1":
        return outcome(lambda: table.add(*args))  # n defaults to 1
    if name == "add_many":
        slot, pairs = args
        return outcome(lambda: table.add_many(slot, *(x for pair in pairs for x in pair)))
    return outcome(lambda: getattr(table, name)(*args))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.tuples(st.integers(1, 4), st.integers(1, 6)), data=st.data())
def test_counters_agree_with_their_twin(shape: tuple[int, int], data: st.DataObject) -> None:
    slots, fields = shape
    native, twin = Counters(slots, fields), PyCounters(slots, fields)
    for op in data.draw(counter_ops(slots, fields)):
        assert apply_counters(native, op) == apply_counters(twin, op), op
        assert native.snapshot() == twin.snapshot(), op  # nothing half-applied on an error


@pytest.mark.parametrize("ops", [
    [("set", 0, 0, (1 << 63) - 1), ("add1", 0, 0)],  # past the top: wraps to the bottom
    [("set", 0, 0, -(1 << 63)), ("add", 0, 0, -1)],
    [("set", 0, 0, (1 << 63) - 1), ("set", 1, 0, 5), ("totals",)],  # the sum wraps too
    [("add_many", 0, [(0, 1), (9, 1)]), ("snapshot",)],  # a bad pair: nothing added
])
def test_counters_wrap_and_refuse_alike(ops: list[tuple[Any, ...]]) -> None:
    """The edges the generated sequences seldom reach."""
    native, twin = Counters(2, 2), PyCounters(2, 2)
    for op in ops:
        assert apply_counters(native, op) == apply_counters(twin, op), op
    assert native.snapshot() == twin.snapshot()


def test_counters_refuse_the_same_shapes() -> None:
    for slots, fields in [(0, 1), (1, 0), (4097, 1), (1, 4097), (4096, 1)]:
        assert outcome(lambda: Counters(slots, fields).fields) == \
            outcome(lambda: PyCounters(slots, fields).fields)


# Latencies as the worker records them (small, around the exact/log boundary and the powers
# of two) plus the clamps: negative and past ten minutes.
VALUES = st.one_of(
    st.integers(-10, 300),
    st.integers(0, 1 << 31).map(lambda v: v | 0),
    st.integers(7, 31).flatmap(lambda k: st.integers((1 << k) - 2, (1 << k) + 2)),
    st.sampled_from([MAX_US - 1, MAX_US, MAX_US + 1, (1 << 63) - 1, 1 << 63, -(1 << 63)]),
)
QUANTILES = st.lists(st.one_of(st.floats(0, 1), st.sampled_from(
    [0.5, 0.9, 0.99, 0.999, 1.0, 1e-9, 1.5, -0.1])), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slots=st.integers(1, 3), data=st.data())
def test_histograms_agree_with_their_twin(slots: int, data: st.DataObject) -> None:
    native, twin = Histogram(slots), PyHistogram(slots)
    records = data.draw(st.lists(st.tuples(st.integers(-1, slots), VALUES), max_size=80))
    for slot, value in records:
        assert outcome(lambda: native.record(slot, value)) == \
            outcome(lambda: twin.record(slot, value)), (slot, value)
    for slot in range(-2, slots + 1):
        qs = data.draw(QUANTILES)
        for read in (lambda h: h.count(slot), lambda h: h.total_us(slot),
                     lambda h: h.buckets(slot), lambda h: h.percentiles(qs, slot)):
            assert outcome(lambda: read(native)) == outcome(lambda: read(twin)), (slot, qs)


@pytest.mark.parametrize("index", [0, EXACT - 1, EXACT, EXACT + 63, EXACT + 64, BUCKETS - 1])
def test_bucket_bounds_hold_their_values(index: int) -> None:
    """Each bucket's bounds map back to it, and the next value starts the next bucket."""
    assert bucket_index(bucket_lower(index)) == index
    assert bucket_index(bucket_upper(index)) == index
    if index < BUCKETS - 1:
        assert bucket_index(bucket_upper(index) + 1) == index + 1
