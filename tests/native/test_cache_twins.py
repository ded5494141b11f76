"""The shared response cache store against its Python twin (velox.cache.twins.PyCache).

Hypothesis drives both with the same generated operations on a small store (64 KiB: a few
dozen blocks, 16 marker slots, so eviction and the full marker table come up): puts of values
around the block sizes and past the largest value, gets with and without a max age, deletes,
claims, renews, releases, waiters, pending and clear, with a clock that moves by small steps and
past TTLs and leases, and keys of the wrong length. Every answer must be the same value or the
same exception type, and the behaviour's counters the same after every step.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from velox._native import SharedCache
from velox.cache.twins import HEAD_DATA, PyCache

KEYS = [bytes([k]) * 32 for k in range(20)]
# Mostly six keys (so entries are read, replaced and evicted), sometimes others or a short one.
KEY = st.integers(0, 40).map(lambda k: KEYS[k % 6] if k < 36 else KEYS[k - 20] if k < 40
                             else b"short")
SIZE = st.one_of(st.integers(0, 3 * 512), st.integers(1000, 6000), st.integers(1000, 6000),
                 st.sampled_from([HEAD_DATA, HEAD_DATA + 1, 7000, 8000, 20_000]))
MS = st.integers(0, 60).map(lambda k: [0, -1, 1 << 50, (1 << 50) + 1][k - 57] if k > 56
                            else 1 + k * 7)
STEP = st.one_of(st.integers(0, 5), st.integers(0, 50), st.just(300))

OPS = st.one_of(
    st.tuples(st.just("put"), KEY, SIZE, MS), st.tuples(st.just("put"), KEY, SIZE, MS),
    st.tuples(st.just("get"), KEY, st.one_of(st.none(), st.integers(-1, 100))),
    st.tuples(st.just("get"), KEY, st.integers(0, 8)), st.tuples(st.just("get"), KEY, st.just(-1)),
    st.tuples(st.just("get"), KEY, st.just(-1)),
    st.tuples(st.just("waiting"), KEY),
    st.tuples(st.just("delete"), KEY),
    st.tuples(st.just("claim"), KEY, MS), st.tuples(st.just("claim"), KEY, MS),
    st.tuples(st.just("renew"), KEY, MS),
    st.tuples(st.just("release"), KEY),
    st.tuples(st.just("unwait"), KEY),
    st.tuples(st.just("waiting"), KEY),
    st.tuples(st.just("pending"), KEY),
    st.tuples(st.just("clear")),
)


def outcome(call: Any) -> Any:
    try:
        return ("value", call())
    except (ValueError, TypeError, OverflowError) as exc:
        return ("raised", type(exc))


def call(store: Any, op: tuple[Any, ...], now: int) -> Any:
    name, *args = op
    if name == "put":
        key, size, ttl = args
        return store.put(key, bytes([size % 251]) * size, now, ttl)
    if name == "get":
        return store.get(args[0], now, args[1])
    if name in ("claim", "renew"):
        return getattr(store, name)(args[0], now, args[1])
    if name == "pending":
        return store.pending(args[0], now)
    return getattr(store, name)(*args)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(OPS, STEP), min_size=20, max_size=150))
def test_the_store_does_what_its_twin_does(steps: list[tuple[tuple[Any, ...], int]]) -> None:
    native = SharedCache(1 << 16)
    geometry = native.stats()
    twin = PyCache(geometry["blocks"], geometry["max_value"], geometry["marker_slots"])
    now = 1_000
    for op, step in steps:
        now += step
        assert outcome(lambda: call(native, op, now)) == outcome(lambda: call(twin, op, now)), op
        stats = native.stats()
        assert {k: stats[k] for k in twin.stats()} == twin.stats(), op
    assert native._check() == 0


def test_a_hit_keeps_its_entry_through_evictions_in_both() -> None:
    """Directed (the generated runs seldom read an entry just before the store is full): an
    entry read before every put outlives entries never read, in the store and in its twin
    alike; a twin that did not move a hit to the recent end fails here."""
    native = SharedCache(1 << 16)
    geometry = native.stats()
    twin = PyCache(geometry["blocks"], geometry["max_value"], geometry["marker_slots"])
    keys = [k.to_bytes(2, "big") * 16 for k in range(400)]
    value = b"v" * 2000  # several blocks each: the 64 KiB store holds a few dozen
    for store in (native, twin):
        now = 1_000
        assert store.put(keys[0], value, now, 1 << 40)
        for key in keys[1:]:
            now += 1
            assert store.get(keys[0], now, -1) is not None, "the entry read before every put"
            assert store.put(key, value, now, 1 << 40)
        assert store.get(keys[1], now, -1) is None  # never read: evicted long ago
        assert store.stats()["evictions"] > 300
    stats = native.stats()
    assert {k: stats[k] for k in twin.stats()} == twin.stats()
