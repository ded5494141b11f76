"""The response cache store's hit and put costs: velox._native.SharedCache (one LRU shared by
every worker, in shared memory, behind a process-shared lock; values are copied out) against
a per-worker Python LRU (collections.OrderedDict with move_to_end, the seed's design; values
are handed out by reference, no copy).

Groups (per operation; each benchmarked call does N operations over a working set of 256
keys, all present, so every get is a hit):

* cache-get 1 KiB:   get(key, now) of a 1 KiB value
* cache-get 16 KiB:  the same with 16 KiB values (above the binding's 4 KiB stack buffer:
                     two lock round trips, the copy goes straight into the bytes object)
* cache-put 1 KiB / 16 KiB: put(key, value, now, ttl) replacing an existing entry

Both contenders implement the same contract (TTL checked, age returned, LRU bumped on a
hit, byte-bounded eviction on put). The native figure runs last in its group and records
`ratio_vs_py_lru` = Python per-op median / native per-op median (> 1: native is faster).
What the shared store buys is not in these figures but in benches/cache_sim.py: one copy of
each answer and one miss per prompt for the whole gateway, instead of per worker.

Run: `.venv/bin/pytest --benchmark benches/bench_cache.py`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from itertools import repeat
from typing import Any

from velox._native import SharedCache

N = 1000  # operations per benchmarked call
KEYS = 256
T0 = 10**9
DAY = 86_400_000

MEDIANS: dict[str, float] = {}


class PyLRU:
    """A per-worker LRU as the seed builds it: OrderedDict, move_to_end on a hit, popitem
    from the old end while over its byte budget. Same contract as SharedCache."""

    __slots__ = ("data", "max_bytes", "bytes")

    def __init__(self, max_bytes: int) -> None:
        self.data: OrderedDict[bytes, tuple[bytes, int, int]] = OrderedDict()
        self.max_bytes = max_bytes
        self.bytes = 0

    def get(self, key: bytes, now_ms: int, max_age_ms: int = -1) -> tuple[bytes, int] | None:
        item = self.data.get(key)
        if item is None:
            return None
        value, created, expires = item
        if now_ms >= expires:
            del self.data[key]
            self.bytes -= len(value)
            return None
        age = now_ms - created if now_ms > created else 0
        if 0 <= max_age_ms < age:
            return None
        self.data.move_to_end(key)
        return value, age

    def put(self, key: bytes, value: bytes, now_ms: int, ttl_ms: int) -> bool:
        old = self.data.pop(key, None)
        if old is not None:
            self.bytes -= len(old[0])
        self.data[key] = (value, now_ms, now_ms + ttl_ms)
        self.bytes += len(value)
        while self.bytes > self.max_bytes:
            _, (v, _, _) = self.data.popitem(last=False)
            self.bytes -= len(v)
        return True


def keys() -> list[bytes]:
    return [hashlib.sha256(b"prompt %d" % i).digest() for i in range(KEYS)]


def filled(kind: str, size: int) -> tuple[Any, list[bytes]]:
    ks = keys()
    store: Any = SharedCache(64 << 20) if kind == "shared" else PyLRU(64 << 20)
    for i, k in enumerate(ks):
        store.put(k, bytes([i % 251]) * size, T0, DAY)
    return store, ks


def record(benchmark: Any, name: str, note: str) -> None:
    per_op_ns = benchmark.stats.stats.median / N * 1e9
    MEDIANS[name] = per_op_ns
    benchmark.extra_info.update(
        {"items_per_call": N, "median_per_item_ns": round(per_op_ns, 2), "per": note}
    )


def ratio(benchmark: Any, native: str, base: str) -> None:
    if base in MEDIANS:
        benchmark.extra_info["ratio_vs_py_lru"] = round(MEDIANS[base] / MEDIANS[native], 2)


def _get_loop(store: Any, ks: list[bytes], size: int) -> Any:
    get = store.get
    seq = [ks[(i * 97) % KEYS] for i in range(N)]  # a spread-out, repeating order

    def run() -> None:
        for k in seq:
            v = get(k, T0 + 1)
        assert v is not None and len(v[0]) == size

    return run


def _put_loop(store: Any, ks: list[bytes], size: int) -> Any:
    put = store.put
    seq = [ks[(i * 97) % KEYS] for i in range(N)]
    val = b"p" * size

    def run() -> None:
        for k in seq:
            put(k, val, T0, DAY)

    return run


def _bench(benchmark: Any, group: str, kind: str, size: int, op: str) -> None:
    benchmark.group = group
    store, ks = filled(kind, size)
    loop = _get_loop if op == "get" else _put_loop
    benchmark(loop(store, ks, size))
    name = f"{op}_{size}_{kind}"
    note = f"{op} of a {size}-byte value"
    record(benchmark, name, note)
    if kind == "shared":
        ratio(benchmark, name, f"{op}_{size}_py")
        assert store._check() == 0
        s = store.stats()
        benchmark.extra_info["entries"] = s["entries"]
        benchmark.extra_info["bytes"] = s["bytes"]


def test_get_1k_py_lru(benchmark: Any) -> None:
    _bench(benchmark, "cache-get 1 KiB: per hit", "py", 1024, "get")


def test_get_1k_shared(benchmark: Any) -> None:
    _bench(benchmark, "cache-get 1 KiB: per hit", "shared", 1024, "get")


def test_get_16k_py_lru(benchmark: Any) -> None:
    _bench(benchmark, "cache-get 16 KiB: per hit", "py", 16384, "get")


def test_get_16k_shared(benchmark: Any) -> None:
    _bench(benchmark, "cache-get 16 KiB: per hit", "shared", 16384, "get")


def test_put_1k_py_lru(benchmark: Any) -> None:
    _bench(benchmark, "cache-put 1 KiB: per put", "py", 1024, "put")


def test_put_1k_shared(benchmark: Any) -> None:
    _bench(benchmark, "cache-put 1 KiB: per put", "shared", 1024, "put")


def test_put_16k_py_lru(benchmark: Any) -> None:
    _bench(benchmark, "cache-put 16 KiB: per put", "py", 16384, "put")


def test_put_16k_shared(benchmark: Any) -> None:
    _bench(benchmark, "cache-put 16 KiB: per put", "shared", 16384, "put")


def test_empty_loop_baseline(benchmark: Any) -> None:
    """The loop and call overhead alone (a bound method returning a constant), to read the
    figures above against."""
    benchmark.group = "cache-get 1 KiB: per hit"
    d = {b"k": (b"v", 0)}
    get = d.get

    def run() -> None:
        for _ in repeat(None, N):
            get(b"k")

    benchmark(run)
    record(benchmark, "dict_get", "dict.get, for scale")
