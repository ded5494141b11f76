"""velox._native.SharedCache: the gateway-wide response cache store (native/vx_cache.c).

Semantics through the binding with an explicit clock (round trip, exact LRU eviction, TTL,
max_age, replace, too-large values, markers with waiters and expiry); bad arguments as
ValueError/TypeError naming the argument; bytes-like keys and values; forked processes sharing
one cache (a child puts, the parent gets; several processes hammering it keep every invariant);
a process SIGKILLed while holding the lock does not wedge the others; values of 64 KiB and more
(copied with the GIL released) stay intact under threads; filling far past the capacity keeps
the resident memory within the bound.
"""

from __future__ import annotations

import ast
import gc
import hashlib
import os
import signal
import threading
import time
from collections.abc import Callable

import psutil
import pytest

from velox._native import SharedCache

T0 = 10**9  # an explicit clock well clear of the real one
DAY = 86_400_000
HEAD = 512 - 72  # value bytes in an entry's first block
MB = 1 << 20


def key(i: int | str) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def blocks_for(n: int) -> int:
    return 1 if n <= HEAD else 1 + -(-(n - HEAD) // 512)


def value(i: int, n: int) -> bytes:
    """n bytes that identify i (so a mixed-up or torn value is caught)."""
    pattern = f"<{i}:{n}>".encode()
    return (pattern * (n // len(pattern) + 1))[:n]


def in_child(body: Callable[[], object], timeout: float = 20.0) -> bytes:
    """Fork; the child runs body() and writes repr(result) to a pipe. Returns those bytes, or
    fails (killing the child) after timeout seconds: a wedged child must not hang the run."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            os.close(r)
            os.write(w, repr(body()).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                assert os.waitstatus_to_exitcode(status) == 0
                return os.read(r, 1 << 16)
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"child did not finish in {timeout} s")
    finally:
        os.close(r)
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- semantics


def test_round_trip_age_and_stats() -> None:
    c = SharedCache(1 * MB)
    assert c.capacity == 1 * MB
    assert c.get(key(1), T0) is None
    for i, n in enumerate([0, 1, HEAD, HEAD + 1, 1024, 4096, 4097, 16384, 100_000]):
        assert c.put(key(i), value(i, n), T0, DAY) is True
        got = c.get(key(i), T0 + 7)
        assert got == (value(i, n), 7)
        assert type(got[0]) is bytes
    s = c.stats()
    sizes = [0, 1, HEAD, HEAD + 1, 1024, 4096, 4097, 16384, 100_000]
    assert s["entries"] == len(sizes)
    assert s["bytes"] == sum(blocks_for(n) for n in sizes) * 512
    assert s["value_bytes"] == sum(sizes)
    assert s["capacity"] == 1 * MB and s["max_value"] == c.max_value
    assert s["hits"] == len(sizes) and s["misses"] == 1 and s["evictions"] == 0
    assert s["mapped"] <= 1 * MB + 512
    assert c._check() == 0


def test_exact_lru_eviction_order() -> None:
    c = SharedCache(65536)
    n = c.stats()["blocks"]
    for i in range(n):  # one block each: exactly fills the pool
        assert c.put(key(i), b"v%d" % i, T0, DAY)
    assert c.stats()["evictions"] == 0
    assert c.get(key(0), T0) is not None  # 0 is now the most recently used
    assert c.put(key("new"), b"x", T0, DAY)  # evicts 1, the least recently used
    assert c.get(key(1), T0) is None
    assert c.get(key(0), T0) == (b"v0", 0)
    # A 4-block value evicts exactly the next four least recent: 2, 3, 4, 5.
    assert c.put(key("big"), b"b" * (HEAD + 3 * 512), T0, DAY)
    assert c.stats()["evictions"] == 5
    present = [i for i in range(10) if c.get(key(i), T0) is not None]
    assert present == [0, 6, 7, 8, 9]
    assert c._check() == 0


def test_ttl_removes_and_max_age_keeps() -> None:
    c = SharedCache(65536)
    assert c.put(key("a"), b"hello", T0, 1000)
    assert c.get(key("a"), T0 + 999) == (b"hello", 999)
    assert c.get(key("a"), T0 + 500, 499) is None  # older than asked: a miss...
    assert c.get(key("a"), T0 + 500, max_age_ms=500) == (b"hello", 500)  # ...but still there
    assert c.get(key("a"), T0 + 500, None) == (b"hello", 500)
    assert c.get(key("a"), T0 - 5) == (b"hello", 0)  # a lagging clock never gives age < 0
    s = c.stats()
    assert s["stale"] == 1 and s["entries"] == 1 and s["expired"] == 0
    assert c.get(key("a"), T0 + 1000) is None  # past its TTL: removed
    s = c.stats()
    assert s["expired"] == 1 and s["entries"] == 0 and s["bytes"] == 0
    assert c.get(key("a"), T0) is None


def test_stale_get_does_not_promote() -> None:
    c = SharedCache(65536)
    n = c.stats()["blocks"]
    for i in range(n):
        assert c.put(key(i), b"x", T0 + i, DAY)
    assert c.get(key(0), T0 + n, max_age_ms=0) is None  # too old: not a use
    assert c.put(key("new"), b"x", T0 + n, DAY)
    assert c.get(key(0), T0 + n) is None  # so 0 was still the least recently used


def test_replace_and_too_large() -> None:
    c = SharedCache(65536)
    assert c.put(key("k"), b"a", T0, 100)
    assert c.put(key("k"), b"b" * 3000, T0 + 50, 1000)
    s = c.stats()
    assert s["entries"] == 1 and s["replaced"] == 1
    assert s["bytes"] == blocks_for(3000) * 512 and s["value_bytes"] == 3000
    assert c.get(key("k"), T0 + 500) == (b"b" * 3000, 450)  # the new time and TTL
    big = c.max_value
    assert c.put(key("k"), b"z" * (big + 1), T0, DAY) is False
    assert c.get(key("k"), T0 + 500) == (b"b" * 3000, 450)  # the old entry stays
    assert c.stats()["rejected"] == 1
    assert c.put(key("k2"), b"z" * big, T0, DAY) is True
    assert c.get(key("k2"), T0) == (b"z" * big, 0)
    assert c.delete(key("k2")) is True and c.delete(key("k2")) is False
    c.claim(key("m"), T0, 1000)
    c.clear()
    s = c.stats()
    assert s["entries"] == 0 and s["markers"] == 0 and s["stores"] == 3
    assert c.get(key("k"), T0) is None and c.pending(key("m"), T0) is False
    assert c._check() == 0


def test_markers_lead_wait_expire_takeover_release() -> None:
    c = SharedCache(65536)
    k = key("prompt")
    assert c.pending(k, T0) is False and c.waiting(k) == 0
    assert c.claim(k, T0, 1000) is True  # leader
    assert c.pending(k, T0) is True
    assert [c.claim(k, T0 + i, 1000) for i in range(1, 4)] == [False] * 3
    assert c.waiting(k) == 3
    c.unwait(k)
    assert c.waiting(k) == 2
    # The leader died: after hold_ms the marker no longer blocks; the next claim takes over
    # and those still waiting stay counted.
    assert c.pending(k, T0 + 999) is True and c.pending(k, T0 + 1000) is False
    assert c.claim(k, T0 + 1000, 1000) is True
    assert c.waiting(k) == 2 and c.pending(k, T0 + 1999) is True
    assert c.release(k) is True
    assert c.pending(k, T0 + 1001) is False and c.waiting(k) == 0
    c.unwait(k)  # a late waiter: a no-op, never negative
    assert c.waiting(k) == 0 and c.release(k) is False
    s = c.stats()
    assert s["claims"] == 5 and s["takeovers"] == 1 and s["markers"] == 0


def test_marker_table_is_bounded() -> None:
    c = SharedCache(65536)
    slots = c.stats()["marker_slots"]
    for i in range(slots):
        assert c.claim(key(i), T0, 1000)
    assert c.stats()["markers"] == slots
    assert c.claim(key("one more"), T0, 1000) is True  # leads, without a marker
    assert c.pending(key("one more"), T0) is False
    assert c.stats()["markers_full"] == 1
    assert c.claim(key("later"), T0 + 1000, 1000) is True  # the expired ones are swept
    assert c.pending(key("later"), T0 + 1000) is True
    assert c.stats()["markers"] == 1
    assert c._check() == 0


def test_bytes_like_keys_and_values() -> None:
    c = SharedCache(65536)
    k = key(1)
    assert c.put(bytearray(k), memoryview(b"abc"), T0, DAY)
    assert c.get(memoryview(k), T0) == (b"abc", 0)
    assert c.put(k, bytearray(b"x" * 5000), T0, DAY)
    assert c.get(k, T0) == (b"x" * 5000, 0)


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda c: SharedCache(65535), ValueError, "capacity_bytes"),
        (lambda c: SharedCache(2**40 + 1), ValueError, "capacity_bytes"),
        (lambda c: SharedCache(2**100), ValueError, "capacity_bytes"),
        (lambda c: SharedCache("64"), TypeError, None),
        (lambda c: SharedCache(1.5), TypeError, None),
        (lambda c: c.get(b"short", T0), ValueError, "32 bytes"),
        (lambda c: c.get(key(1) + b"x", T0), ValueError, "32 bytes"),
        (lambda c: c.get("x" * 32, T0), TypeError, None),
        (lambda c: c.get(None, T0), TypeError, None),
        (lambda c: c.get(key(1), -1), ValueError, "now_ms"),
        (lambda c: c.get(key(1), 2**60), ValueError, "now_ms"),
        (lambda c: c.get(key(1), 1.0), TypeError, None),
        (lambda c: c.get(key(1), T0, -2), ValueError, "max_age_ms"),
        (lambda c: c.get(key(1)), TypeError, "now_ms"),
        (lambda c: c.get(key(1), T0, -1, 4), TypeError, "at most"),
        (lambda c: c.get(key(1), T0, nope=1), TypeError, "nope"),
        (lambda c: c.get(key(1), T0, now_ms=T0), TypeError, "multiple"),
        (lambda c: c.put(key(1), b"v", T0, 0), ValueError, "ttl_ms"),
        (lambda c: c.put(key(1), b"v", T0, 2**100), ValueError, "ttl_ms"),
        (lambda c: c.put(key(1), "text", T0, 1), TypeError, None),
        (lambda c: c.put(key(1), b"v", T0), TypeError, "ttl_ms"),
        (lambda c: c.claim(key(1), T0, 0), ValueError, "hold_ms"),
        (lambda c: c.claim(b"", T0, 1), ValueError, "32 bytes"),
        (lambda c: c.pending(key(1), -5), ValueError, "now_ms"),
        (lambda c: c.unwait(b"x"), ValueError, "32 bytes"),
        (lambda c: c.waiting(1), TypeError, None),
        (lambda c: c.release(b"x" * 31), ValueError, "32 bytes"),
        (lambda c: c.delete(b"x" * 33), ValueError, "32 bytes"),
        (lambda c: c._lock_and_hold(60_001), ValueError, "hold_ms"),
    ],
)
def test_bad_arguments(call: Callable[[SharedCache], object], exc: type, match: str | None) -> None:
    c = SharedCache(65536)
    with pytest.raises(exc, match=match):
        call(c)
    assert c.stats()["entries"] == 0


def test_keyword_arguments() -> None:
    c = SharedCache(65536)
    assert c.put(key=key(1), value=b"v", now_ms=T0, ttl_ms=10)
    assert c.get(key=key(1), now_ms=T0 + 1, max_age_ms=1) == (b"v", 1)
    assert c.claim(key(1), now_ms=T0, hold_ms=5) is True
    assert c.pending(key=key(1), now_ms=T0) is True


# ---------------------------------------------------------------- processes and threads


def test_child_puts_parent_gets() -> None:
    c = SharedCache(4 * MB)  # created before fork, like the supervisor does

    def child() -> int:
        for i in range(100):
            assert c.put(key(i), value(i, 100 + 37 * i), T0, DAY)
        assert c.claim(key("lead"), T0, DAY)
        return c.stats()["entries"]

    assert in_child(child) == b"100"
    for i in range(100):
        assert c.get(key(i), T0 + 3) == (value(i, 100 + 37 * i), 3)
    # The child claimed a day's lease, then exited (reaped): its marker is dead at once, and
    # the next claim takes the key over.
    assert c.pending(key("lead"), T0) is False
    assert c.claim(key("lead"), T0, DAY) is True and c.stats()["takeovers"] == 1


def test_a_live_leader_in_another_process_renews_and_keeps_its_marker() -> None:
    c = SharedCache(4 * MB)
    k = key("lead")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child: leads, then waits to be killed
        os.close(r)
        ok = c.claim(k, T0, 100) and c.renew(k, T0 + 50, 100)
        os.write(w, b"1" if ok else b"0")
        time.sleep(30)
        os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"1"
        # Another process's marker: a waiter here, and neither renew nor release touch it.
        assert c.pending(k, T0 + 149) is True and c.claim(k, T0 + 149, 100) is False
        assert c.renew(k, T0 + 149, DAY) is False and c.release(k) is False
        assert c.waiting(k) == 1
        # The leader is SIGKILLed: once reaped, its marker no longer holds the key.
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pid = 0
        assert c.pending(k, T0 + 149) is False
        assert c.claim(k, T0 + 149, 100) is True and c.waiting(k) == 1  # waiters stay counted
        assert c.renew(k, T0 + 200, 100) is True and c.release(k) is True
    finally:
        os.close(r)
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_processes_hammering_one_cache_keep_invariants() -> None:
    c = SharedCache(256 * 1024)  # small: constant eviction across processes

    def hammer(seed: int) -> tuple[int, int]:
        import random

        rnd = random.Random(seed)
        hits = bad = 0
        for n in range(20_000):
            i = rnd.randrange(300)
            if rnd.random() < 0.3:
                c.put(key(i), value(i, rnd.randrange(24, 6000)), T0 + n // 8, 500)
            elif rnd.random() < 0.1:
                if not c.claim(key(i), T0 + n // 8, 50):
                    c.unwait(key(i))
                else:
                    c.release(key(i))
            else:
                got = c.get(key(i), T0 + n // 8)
                if got is not None:
                    hits += 1
                    v = got[0]
                    bad += v != value(i, len(v))
        return hits, bad

    pids = []
    for seed in range(3):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                os.write(w, repr(hammer(seed)).encode())
            finally:
                os._exit(0)
        os.close(w)
        pids.append((pid, r))
    own = hammer(99)
    results = [own]
    for pid, r in pids:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        results.append(ast.literal_eval(os.read(r, 4096).decode()))
        os.close(r)
    assert all(bad == 0 for _, bad in results), results
    assert sum(h for h, _ in results) > 0
    s = c.stats()
    assert s["evictions"] > 0 and s["hits"] == sum(h for h, _ in results)
    assert s["bytes"] <= s["blocks"] * 512
    assert c._check() == 0


def test_exactly_one_leader_per_key_across_processes() -> None:
    # Cross-worker coalescing: processes racing to claim the same keys (each in its own
    # shuffled order) get exactly one leader per key; everyone else is counted as a waiter.
    # Every racer stays alive until all have claimed: a marker is a lease owned by its pid,
    # and a reaped leader's keys may rightly be taken over by a racer still claiming.
    c = SharedCache(1 * MB)
    keys = [key(f"race {i}") for i in range(200)]
    procs = 4
    go_r, go_w = os.pipe()
    end_r, end_w = os.pipe()

    def racer(seed: int) -> list[int]:
        import random

        order = list(range(len(keys)))
        random.Random(seed).shuffle(order)
        os.read(go_r, 1)  # start together
        return [i for i in order if c.claim(keys[i], T0, DAY)]

    children = []
    for seed in range(procs):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                os.write(w, repr(racer(seed)).encode())
                os.close(w)
                os.read(end_r, 1)  # alive until every racer has claimed
            finally:
                os._exit(0)
        os.close(w)
        children.append((pid, r))
    os.write(go_w, b"x" * procs)
    led: list[int] = []
    for _, r in children:
        chunks = []
        while chunk := os.read(r, 1 << 16):
            chunks.append(chunk)
        os.close(r)
        led += ast.literal_eval(b"".join(chunks).decode())
    os.write(end_w, b"x" * procs)
    for pid, _ in children:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    for fd in (go_r, go_w, end_r, end_w):
        os.close(fd)
    assert sorted(led) == list(range(len(keys)))  # each key led once, by one process
    assert all(c.waiting(k) == procs - 1 for k in keys)
    assert c.stats()["markers"] == len(keys)


def test_killed_lock_holder_does_not_wedge_the_others() -> None:
    c = SharedCache(1 * MB)
    assert c.put(key("before"), b"old", T0, DAY)
    holder = os.fork()
    if holder == 0:  # pragma: no cover - child
        try:
            c._lock_and_hold(30_000)  # SIGKILLed long before it ends
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while not c._holding() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert c._holding(), "the child never took the lock"
        os.kill(holder, signal.SIGKILL)
    finally:
        os.waitpid(holder, 0)

    # Another process (not this one: a wedged call here would hang the run while holding
    # the GIL) finds the lock's owner dead, wipes the cache and carries on.
    def other() -> tuple[object, ...]:
        gone = c.get(key("before"), T0)
        stored = c.put(key("after"), b"new", T0, DAY)
        return gone, stored, c.get(key("after"), T0), c.stats()["recoveries"]

    assert in_child(other, timeout=20) == repr((None, True, (b"new", 0), 1)).encode()
    assert c.get(key("after"), T0) == (b"new", 0)
    assert c._holding() is False
    assert c.stats()["recoveries"] == 1
    assert c._check() == 0


def test_a_live_holder_only_delays_the_others() -> None:
    c = SharedCache(1 * MB)
    t = threading.Thread(target=c._lock_and_hold, args=(300,))
    t.start()
    deadline = time.monotonic() + 10
    while not c._holding() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert c.put(key(1), b"v", T0, DAY)  # waits for the holder, then goes through
    t.join()
    assert c.get(key(1), T0) == (b"v", 0)
    assert c.stats()["recoveries"] == 0


def test_large_values_under_threads_stay_intact() -> None:
    # Values of 64 KiB and more are copied with the GIL released: threads interleave there.
    c = SharedCache(16 * MB)
    errors: list[str] = []

    def worker(t: int) -> None:
        for n in range(60):
            i = (t * 7 + n) % 12
            size = 64 * 1024 + 4099 * i
            if n % 3 == 0:
                c.put(key(i), value(i, size), T0, DAY)
            got = c.get(key(i), T0)
            if got is not None and got[0] != value(i, len(got[0])):
                errors.append(f"thread {t}: torn value for {i}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert c.stats()["hits"] > 0
    assert c._check() == 0


def test_memory_stays_within_the_bound_when_filled_far_past_it() -> None:
    cap = 16 * MB
    proc = psutil.Process()
    gc.collect()
    before = proc.memory_info().rss
    c = SharedCache(cap)
    assert c.stats()["mapped"] <= cap + 512
    written = 0
    i = 0
    while written < 12 * cap:  # 192 MiB through a 16 MiB cache
        n = 256 + (i * 7919) % 40_000
        c.put(key(i), value(i, n), T0, DAY)
        written += n
        i += 1
    gc.collect()
    grown = proc.memory_info().rss - before
    s = c.stats()
    assert s["evictions"] > 0.8 * i
    assert s["bytes"] <= s["blocks"] * 512 <= cap
    # The whole mapping resident is at most cap + 512 B; allow 4 MiB for the interpreter's
    # own churn (the values were built and dropped one by one).
    assert grown <= cap + 4 * MB, (grown, cap)
    assert c._check() == 0


def test_hit_rate_simulation_smoke() -> None:
    # benches/cache_sim.py on a small stream: the shared LRU misses each prompt once for the
    # gateway, so with room for every answer it reaches the best possible hit rate, while
    # per-worker caches miss each prompt once per worker; the native store replays the same.
    from benches.cache_sim import simulate

    r = simulate(requests=20_000, repeat=0.5, cap=64 * MB, seed=3)
    rows = {(x["workers"], x["design"]): x for x in r["rows"]}
    best = r["max_hit_rate"]
    assert rows[(1, "shared")]["hit_rate"] == best
    assert rows[(4, "shared (native SharedCache)")]["hit_rate"] == best
    assert rows[(4, "per-worker C")]["hit_rate"] < best - 0.05
    assert rows[(4, "per-worker C")]["held_more_than_once"] > 0
    assert rows[(8, "per-worker C/N")]["hit_rate"] < rows[(2, "per-worker C/N")]["hit_rate"]
    assert all(x["upstream_calls"] + x["upstream_calls_saved"] == 20_000 for x in r["rows"])
