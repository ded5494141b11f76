"""velox._native.Counters and Histogram: semantics, bad input, accuracy against exact
percentiles of a known sample, and sharing across fork."""

from __future__ import annotations

import math
import multiprocessing
import random
import threading

import pytest

from velox._native import Counters, Histogram

HIST_MAX_US = 600_000_000  # 10 minutes


def rel_error_ok(approx: int, exact: int) -> bool:
    """Midpoint of a bucket at most 1/64 of its lower bound wide: within 1/128 (0.78%),
    inside the documented ~1.6% (and the issue's 3%)."""
    return abs(approx - exact) * 128 <= exact


def in_child(target: object, *args: object) -> None:
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=target, args=args)
    try:
        proc.start()
        proc.join(timeout=60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


# ---------------------------------------------------------------- Counters


def test_counters_add_set_get_totals_snapshot() -> None:
    c = Counters(3, 2)
    assert (c.slots, c.fields) == (3, 2)
    assert c.totals() == [0, 0]
    c.add(0, 0)
    c.add(1, 0, 5)
    c.add(2, 1, -3)
    c.set(1, 1, 42)
    assert c.get(1, 0) == 5
    assert c.get(1, 1) == 42
    assert c.totals() == [6, 39]
    assert c.snapshot() == [[1, 0], [5, 42], [0, -3]]
    c.set(1, 1, 7)  # gauges overwrite
    assert c.get(1, 1) == 7
    c.add(0, 0, 2**63 - 2)  # int64 range is accepted
    assert c.get(0, 0) == 2**63 - 1


@pytest.mark.parametrize("args", [(0, 1), (1, 0), (-1, 1), (4097, 1), (1, 4097), (2**70, 1)])
def test_counters_bad_sizes(args: tuple[int, int]) -> None:
    with pytest.raises(ValueError):
        Counters(*args)


def test_counters_bad_indices_and_values() -> None:
    c = Counters(2, 3)
    for slot, field in [(2, 0), (-1, 0), (0, 3), (0, -1), (2**80, 0)]:
        with pytest.raises(IndexError):
            c.add(slot, field)
        with pytest.raises(IndexError):
            c.get(slot, field)
        with pytest.raises(IndexError):
            c.set(slot, field, 1)
    with pytest.raises(ValueError):
        c.add(0, 0, 2**63)
    with pytest.raises(ValueError):
        c.set(0, 0, -(2**63) - 1)
    with pytest.raises(TypeError):
        c.add(0, 0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        c.add("0", 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        c.add(0)  # type: ignore[call-arg]
    assert c.totals() == [0, 0, 0]


def test_counters_threads() -> None:
    c = Counters(4, 1)

    def work(slot: int) -> None:
        for _ in range(20_000):
            c.add(slot, 0)
            c.add(0, 0)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert c.totals() == [160_000]
    assert c.snapshot() == [[100_000], [20_000], [20_000], [20_000]]


def _child_counts(c: Counters) -> None:
    for _ in range(1000):
        c.add(1, 0)
    c.set(1, 1, 99)


def test_counters_shared_across_fork() -> None:
    c = Counters(2, 2)
    c.add(0, 0, 5)
    in_child(_child_counts, c)
    assert c.totals() == [1005, 99]
    assert c.snapshot() == [[5, 0], [1000, 99]]


# ---------------------------------------------------------------- Histogram


def test_histogram_exact_below_128_and_bucket_listing() -> None:
    h = Histogram(2)
    assert h.slots == 2
    for v in (0, 1, 1, 5, 127):
        h.record(0, v)
    h.record(1, -50)  # negative counts as 0
    assert h.count() == 6
    assert h.count(0) == 5
    assert h.count(1) == 1
    assert h.total_us() == 134
    assert h.total_us(1) == 0
    assert h.buckets() == [(0, 2), (1, 2), (5, 1), (127, 1)]
    assert h.buckets(1) == [(0, 1)]
    assert h.percentiles([0.01, 0.5, 0.99, 1.0]) == [0, 1, 127, 127]
    assert h.percentiles([0.5], slot=0) == [1]


def test_histogram_empty_is_zero() -> None:
    h = Histogram(3)
    assert h.percentiles([0.5, 0.99]) == [0, 0]
    assert h.percentiles([0.5], 2) == [0]
    assert h.percentiles([]) == []
    assert h.count() == 0
    assert h.total_us() == 0
    assert h.buckets() == []


def test_histogram_buckets_ascending_and_cover_values() -> None:
    h = Histogram(1)
    values = [128, 129, 130, 1000, 12_345, 10**6, 59 * 10**6, HIST_MAX_US]
    for v in values:
        h.record(0, v)
    buckets = h.buckets()
    uppers = [u for u, _ in buckets]
    assert uppers == sorted(uppers)
    assert sum(n for _, n in buckets) == len(values)
    for v in values:  # each value's bucket is the first whose upper bound reaches it
        upper = next(u for u in uppers if u >= v)
        assert (upper - v) * 64 <= v


def test_histogram_clamps_above_ten_minutes() -> None:
    h = Histogram(1)
    h.record(0, HIST_MAX_US)
    h.record(0, 10**12)
    assert h.count() == 2
    assert h.total_us() == HIST_MAX_US + 10**12  # the sum keeps the real values
    assert len(h.buckets()) == 1  # both in the top bucket
    (p100,) = h.percentiles([1.0])
    assert rel_error_ok(p100, HIST_MAX_US)


def test_histogram_lognormal_percentiles_match_exact() -> None:
    rng = random.Random(20240611)
    sample = [int(rng.lognormvariate(9.0, 1.5)) for _ in range(100_000)]
    h = Histogram(4)
    for i, v in enumerate(sample):
        h.record(i % 4, v)
    ordered = sorted(sample)
    qs = [0.5, 0.9, 0.99, 0.999, 0.0001, 1.0]
    got = h.percentiles(qs)
    for q, approx in zip(qs, got, strict=False):
        exact = ordered[math.ceil(q * len(ordered)) - 1]  # nearest rank
        assert rel_error_ok(approx, exact), (q, approx, exact)
    assert h.count() == len(sample)
    assert h.total_us() == sum(sample)
    # One slot alone is also within bounds of its own exact percentiles.
    slot0 = sorted(sample[0::4])
    (p99,) = h.percentiles([0.99], slot=0)
    assert rel_error_ok(p99, slot0[math.ceil(0.99 * len(slot0)) - 1])


def test_histogram_bad_arguments() -> None:
    for bad in (0, -1, 4097, 2**70):
        with pytest.raises(ValueError):
            Histogram(bad)
    h = Histogram(2)
    h.record(0, 10)
    for q in (0.0, -0.5, 1.0000001, 2, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            h.percentiles([0.5, q])
    with pytest.raises(TypeError):
        h.percentiles(["0.5"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        h.percentiles(0.5)  # type: ignore[arg-type]
    for slot in (2, -2, 2**80):
        with pytest.raises(IndexError):
            h.percentiles([0.5], slot)
        with pytest.raises(IndexError):
            h.count(slot)
        with pytest.raises(IndexError):
            h.buckets(slot)
        with pytest.raises(IndexError):
            h.total_us(slot)
    for slot in (2, -1):
        with pytest.raises(IndexError):
            h.record(slot, 5)
    with pytest.raises(ValueError):
        h.record(0, 2**63)
    with pytest.raises(TypeError):
        h.record(0, 1.5)  # type: ignore[arg-type]
    assert h.count() == 1


def _child_records(h: Histogram) -> None:
    for v in range(1, 1001):
        h.record(1, v * 1000)


def test_histogram_shared_across_fork() -> None:
    h = Histogram(2)
    h.record(0, 5)
    in_child(_child_records, h)
    assert h.count() == 1001
    assert h.count(1) == 1000
    assert h.total_us(1) == 1000 * 1001 // 2 * 1000
    (p50,) = h.percentiles([0.5], slot=1)
    assert rel_error_ok(p50, 500_000)
