"""Reference and memory ownership of velox._native: nothing leaks through a million
push/pop cycles, objects left in a ring are released with it, the cache's entry points keep
refcounts and memory flat (hits, misses, both get paths, errors), creating/destroying the
shared-memory objects unmaps what they mapped, and the native HTTP/2 codec's entry points
(requests, events, errors) keep references and memory flat."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from velox._native import (
    BudgetGate,
    Counters,
    Health,
    Histogram,
    Limits,
    Rendezvous,
    RetryBudget,
    Ring,
    SharedCache,
    hash64,
)
from velox_lab._bucket import TokenBucket

MB = 1 << 20


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def mapping_count() -> int:
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps")
    return len(maps.read_text().splitlines())


class Item:
    """Weak-referenceable, and big enough (with its dict) that a leak of 1M shows in RSS."""

    def __init__(self, i: int) -> None:
        self.i = i


def test_million_push_pop_keeps_refcount_and_rss_flat() -> None:
    ring = Ring(1024)
    sentinel = object()
    base_refs = sys.getrefcount(sentinel)
    push, pop = ring.try_push, ring.try_pop
    for _ in range(10_000):  # warm-up: let the allocator reach its steady state
        push(Item(0))
        pop()
    before = rss()
    for i in range(1_000_000):
        push(sentinel)
        assert pop() is sentinel
        push(Item(i))  # a fresh object each time: a leaked reference would keep it alive
        pop()
    assert sys.getrefcount(sentinel) == base_refs
    assert rss() - before < 8 * MB  # a leak of 1M Items would be well over 100 MB


def test_million_through_pop_batch_keeps_refcount_flat() -> None:
    ring = Ring(128)
    sentinel = object()
    base_refs = sys.getrefcount(sentinel)
    before = rss()
    for _ in range(1_000_000 // 64):
        for _ in range(64):
            ring.try_push(sentinel)
        batch = ring.pop_batch(64)
        assert len(batch) == 64
        del batch
    assert sys.getrefcount(sentinel) == base_refs
    assert rss() - before < 8 * MB


def test_failed_push_does_not_keep_a_reference() -> None:
    ring = Ring(2)
    sentinel = object()
    ring.try_push(1)
    ring.try_push(2)
    base_refs = sys.getrefcount(sentinel)
    for _ in range(10_000):
        assert ring.try_push(sentinel) is False
    assert sys.getrefcount(sentinel) == base_refs


def test_items_left_in_ring_are_released_on_destruction() -> None:
    ring = Ring(64)
    items = [Item(i) for i in range(50)]
    refs = [weakref.ref(x) for x in items]
    sentinel = object()
    base_refs = sys.getrefcount(sentinel)
    for x in items:
        ring.try_push(x)
    for _ in range(10):
        ring.try_push(sentinel)
    assert sys.getrefcount(sentinel) == base_refs + 10
    del items, x
    assert all(r() is not None for r in refs)  # the ring keeps them alive
    del ring  # no cycle: freed by refcount, without the collector
    assert all(r() is None for r in refs)
    assert sys.getrefcount(sentinel) == base_refs


def test_errors_do_not_leak_arguments() -> None:
    big = 2**100
    base_refs = sys.getrefcount(big)
    ring = Ring(2)
    bucket = TokenBucket(10, 10)
    for _ in range(10_000):
        with pytest.raises(ValueError):
            Ring(big)
        with pytest.raises(ValueError):
            TokenBucket(big, 1)
        assert bucket.acquire(big) is False
        with pytest.raises(ValueError):
            ring.pop_batch(-big)
    assert sys.getrefcount(big) == base_refs


def test_create_destroy_unmaps_shared_memory() -> None:
    def churn() -> None:
        for _ in range(2000):
            TokenBucket(100, 100).acquire()
            Counters(8, 8).add(7, 7)
            Histogram(4).record(3, 1234)
            Ring(1024).try_push(None)

    churn()  # warm-up
    maps_before, rss_before = mapping_count(), rss()
    churn()
    # A leak would add a mapping per object (6000 here) and at least a touched page each.
    assert mapping_count() <= maps_before + 2  # allow unrelated noise
    assert rss() - rss_before < 8 * MB  # leaking every object above would be ~50 MB


def test_health_entry_points_keep_refcounts_and_mappings_flat() -> None:
    # The per-request calls of the routing layer (velox.state.health, velox.routing.balance): tuples
    # of upstream indices and key bytes go in, ints and tuples come out, a million times.
    health = Health([0, 4, 0], failures=5, successes=2, open_ms=1000, max_open_ms=8000,
                    probes=1, probe_lease_ms=2000)
    budget = RetryBudget(20, 10, 10)
    rendezvous = Rendezvous([hash64(b"a"), hash64(b"b"), hash64(b"c")], [3.0, 1.0, 1.0])
    us = (0, 1, 2)
    key = b"x-velox-affinity value"
    base_us, base_key = sys.getrefcount(us), sys.getrefcount(key)
    for i in range(10_000):  # warm-up
        ticket = health.allow(i % 3, i)
        if ticket >= 0:
            health.finish(i % 3, ticket, 1, i)
    before = rss()
    for i in range(1_000_000):
        health.usable_mask(us, i)
        health.in_flight_sum(us)
        ticket = health.allow(i % 3, i)
        if ticket >= 0:
            health.finish(i % 3, ticket, 1, i)
        rendezvous.rank(hash64(key))
        budget.record_request(i // 1000)
    assert sys.getrefcount(us) == base_us and sys.getrefcount(key) == base_key
    assert all(health.in_flight(u) == 0 for u in us)  # every admission was finished
    assert rss() - before < 8 * MB

    def churn() -> None:
        for _ in range(2000):
            Health([1, 2], failures=5, successes=2, open_ms=1000, max_open_ms=8000, probes=1,
                   probe_lease_ms=2000).allow(0, 1)
            RetryBudget(20, 10, 10).record_request(1)
            Rendezvous([1, 2, 3], [1.0, 1.0, 1.0]).first(7)

    churn()
    maps_before, rss_before = mapping_count(), rss()
    churn()
    assert mapping_count() <= maps_before + 2
    assert rss() - rss_before < 8 * MB


def test_cache_entry_points_keep_refcounts_and_memory_flat() -> None:
    # The per-request calls of the cache stage: a 32-byte key and bytes go in, (bytes, age)
    # tuples come out; both get paths (stack copy below 4 KiB, exact-size bytes above),
    # misses, markers, and errors raised from bad arguments.
    cache = SharedCache(4 * MB)
    keys = [bytes([i]) * 32 for i in range(64)]
    small, large = b"s" * 1000, b"L" * 20_000
    bad_key = b"short"
    base = [sys.getrefcount(x) for x in (small, large, bad_key, keys[0])]

    def round_(i: int) -> None:
        k = keys[i % 64]
        cache.put(k, large if i % 8 == 0 else small, i, 10_000)
        got = cache.get(k, i + 1)
        assert got is not None and len(got[0]) in (1000, 20_000)
        cache.get(keys[(i + 1) % 64], i + 1, 0)  # mostly stale or absent: None
        if not cache.claim(k, i, 100):
            cache.unwait(k)
        cache.waiting(k)
        cache.pending(k, i)
        cache.release(k)
        if i % 64 == 0:
            with pytest.raises(ValueError):
                cache.get(bad_key, i)
            with pytest.raises(ValueError):
                cache.put(k, small, i, 0)

    for i in range(5_000):  # warm-up: every block of the pool touched, allocator settled
        round_(i)
    before = rss()
    for i in range(200_000):
        round_(i)
    assert [sys.getrefcount(x) for x in (small, large, bad_key, keys[0])] == base
    assert rss() - before < 8 * MB  # 200k leaked 1 KB values alone would be 200 MB
    assert cache.stats()["markers"] == 0  # every claim was released

    def churn() -> None:
        for _ in range(500):
            c = SharedCache(1 * MB)
            c.put(keys[0], small, 1, 10)
            c.get(keys[0], 1)
def test_limits_entry_points_keep_refcounts_and_mappings_flat() -> None:
    # The per-request calls of the keys stage (velox.admission.keys): take / admit / enter / leave /
    # refund / charge / level, a million times, plus errors with a big argument.
    lim = Limits(3, slots=4)
    lim.configure(0, 10**9, 10**9)
    lim.configure(1, 10**9, 10**9)
    big = 2**100
    base_big = sys.getrefcount(big)
    for i in range(10_000):  # warm-up
        lim.take(i % 2, 3)
    before = rss()
    for i in range(1_000_000):
        lim.take(i % 2, 3)
        if lim.enter(2, 8, i % 4):
            lim.leave(2, i % 4)
        if lim.admit(0, 1, 2, 2, 8, i % 4) < 0:
            lim.leave(2, i % 4)
        lim.refund(1, 1)
        lim.charge(1, 1)
        lim.level(0)
        lim.taken(0)
    for _ in range(10_000):
        assert lim.take(0, big) == -1
        with pytest.raises(IndexError):
            lim.enter(big, 1, 0)
        with pytest.raises(ValueError):
            Limits(big)
    assert sys.getrefcount(big) == base_big
    assert lim.active(2) == 0
    assert rss() - before < 8 * MB

    def churn() -> None:
        for _ in range(2000):
            other = Limits(100, slots=16)
            other.configure(99, 60, 1)
            other.enter(99, 1, 15)

    churn()
    maps_before, rss_before = mapping_count(), rss()
    churn()
    # A leak would keep 500 mappings of 1 MiB (each with touched pages) alive.
    # A leaked mapping per object would be 2000 mappings and 2000 x (6.4 + 12.8) KB.
    assert mapping_count() <= maps_before + 2
    assert rss() - rss_before < 8 * MB

def test_budget_gate_keeps_refcounts_and_memory_flat() -> None:
    # A budgeted request's two calls (velox.spend.gate), a million times each, the remaining
    # figure's bytes made every admission; refusals and bad arguments; gates made and dropped
    # keep their Limits and Counters alive only while they live.
    lim, in_flight = Limits(2, slots=2), Counters(2, 2)
    for b in range(2):
        lim.configure(b, 0, 10**9)
        lim.give(b, 10**9)
    gate = BudgetGate(lim, in_flight, (1000, 10**6), 1)
    budgets = (0, 1)
    big = 2**100
    base_big, base_lim = sys.getrefcount(big), sys.getrefcount(lim)
    for _ in range(10_000):  # warm-up
        gate.admit(budgets, 5_000)
        gate.settle(budgets, 5_000, 4_321)
    before = rss()
    for i in range(1_000_000):
        assert type(gate.admit(budgets, 5_000 + i % 7)) is bytes
        gate.settle(budgets, 5_000 + i % 7, 4_321)
    empty = Limits(1, slots=2)
    empty.configure(0, 0, 10)
    refusing = BudgetGate(empty, in_flight, (1000,), 0)
    for _ in range(10_000):
        assert refusing.admit((0,), 1000) == 0
        with pytest.raises(ValueError):
            gate.admit(budgets, big)
        with pytest.raises(ValueError):
            gate.settle((5,), 1, 1)
        type_error(gate.admit, [0], 1)
        type_error(BudgetGate, in_flight, lim, (1,), 0)
    assert sys.getrefcount(big) == base_big
    assert in_flight.get(1, 0) == 0 and in_flight.get(1, 1) == 0  # every reservation settled
    assert rss() - before < 8 * MB
    del gate, refusing
    gc.collect()
    assert sys.getrefcount(lim) == base_lim - 1  # the gate's reference went with it


def _frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return n.to_bytes(3, "big") + bytes((ftype, flags)) + sid.to_bytes(4, "big") + payload


def test_h2_codec_entry_points_keep_refcounts_and_rss_flat() -> None:
    # The native HTTP/2 codec's per-request calls, 50k requests on one connection: arguments
    # must not gain references, events must be freed with their lists, and nothing may grow.
    from velox._native import H2Client
    from velox.egress.codec import CodecError

    codec = H2Client(b"api.example.com", b"https", CodecError)
    codec.initiate()
    codec.receive_data(_frame(4, 0, 0))
    method, path = b"POST", b"/v1/chat/completions"
    headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer sk-x")]
    body = b'{"model": "m"}' * 10
    ping = b"12345678"
    watched = (method, path, headers, headers[0], body, ping)
    base = [sys.getrefcount(o) for o in watched]
    # :status 200 plus a literal indexed into the dynamic table, then DATA with END_STREAM.
    head = b"\x88\x40\x05x-idx\x05value"

    def one_request() -> None:
        sid = codec.send_request(method, path, headers, body)
        codec.data_to_send()
        events = codec.receive_data(_frame(1, 4, sid, head) + _frame(0, 1, sid, b"{}"))
        assert events[0][2] == 200 and events[0][3] == [(b"x-idx", b"value")]
        codec.acknowledge(sid, events[1][3])
        codec.reset_stream(sid)  # already finished: nothing to do
        codec.send_ping(ping)

    for _ in range(5_000):  # warm-up
        one_request()
    before = rss()
    for _ in range(50_000):
        one_request()
    codec.data_to_send()
    assert [sys.getrefcount(o) for o in watched] == base
    assert codec.stream_state_count == 0
    assert rss() - before < 8 * MB  # 50k leaked event lists (~25 MB) would show

    # Error paths: refused streams, connection errors carrying events, bad arguments.
    before = rss()
    for _ in range(10_000):
        bad = H2Client(b"a", b"https", CodecError)
        bad.initiate()
        with pytest.raises(CodecError) as info:
            bad.receive_data(_frame(4, 0, 0) + _frame(6, 0, 1, ping))  # PING on a stream
        assert info.value.events == [(6, 512)]
        with pytest.raises(CodecError):
            bad.send_request(method, path, headers, body)
        with pytest.raises(CodecError):
            bad.receive_data(b"more")
        with pytest.raises(ValueError):
            bad.acknowledge(99, 1)
        with pytest.raises(TypeError):
            bad.send_request(method, path, [("str", b"x")], None)
        with pytest.raises(ValueError):
            bad.send_ping(b"short")
        del bad, info
    assert [sys.getrefcount(o) for o in watched] == base


def type_error(fn: Callable[..., object], *args: object) -> None:
    """pytest.raises(TypeError) for hot loops: its context manager costs about 8 us a call,
    which at 300,000 rounds was half of the HTTP/1.1 writer test's time."""
    try:
        fn(*args)
    except TypeError:
        return
    pytest.fail(f"{fn.__name__} raised no TypeError")


def test_http1_writer_keeps_refcounts_and_rss_flat() -> None:
    # The per-response calls of ingress (velox.ingress.h1write): header tuples and bodies go in, one
    # bytes object comes out; the error paths release what they took too.
    from velox._native import (
        H1_CLOSE,
        H1_LENGTH,
        h1_chunks,
        h1_head,
        h1_response,
        h1_server_timing,
    )

    line = b"HTTP/1.1 200 OK\r\n"
    headers = [(b"content-type", b"application/json"), (b"server-timing", b"ring;dur=0.001")]
    many = headers * 20  # past the 32 fields kept on the C stack
    body = b"x" * 300
    pieces = [body, memoryview(body), bytearray(b"yz")] * 12  # past 32 views on the stack
    bad = [body, 3]
    base = [sys.getrefcount(o) for o in (line, headers, many, body, pieces, bad)]
    for _ in range(10_000):  # warm-up
        h1_response(line, headers, body, H1_LENGTH)
    before = rss()
    for _ in range(300_000):
        h1_response(line, headers, body, H1_LENGTH | H1_CLOSE)
        h1_response(line, many, pieces, H1_LENGTH)
        h1_head(line, many, 300, H1_LENGTH)
        h1_chunks(pieces, True)
        h1_server_timing(1 << 40, (1 << 40) + 12345, 3, 4, 5, 1 << 41)
        type_error(h1_response, line, headers, bad, H1_LENGTH)
        type_error(h1_response, line, [(b"a", 1)] * 40, pieces, H1_LENGTH)
    assert [sys.getrefcount(o) for o in (line, headers, many, body, pieces, bad)] == base
    assert rss() - before < 8 * MB
