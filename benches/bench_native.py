"""Head-to-heads of the native core against the pure-Python tools it replaces.

Groups (one `benchmark.group` per comparison; every figure is normalised per item/token):

* ring-pair:   Ring try_push + try_pop vs deque, queue.SimpleQueue, asyncio.Queue
* ring-batch:  64 x try_push + one pop_batch(64) vs deque 64 x append + 64 x popleft
* ring-drain:  draining a full 16,384-slot ring with pop_batch(64) vs a deque popleft loop
               (only the draining is timed; the refill is untimed setup)
* bucket:      TokenBucket.acquire() vs aiolimiter.AsyncLimiter (awaited in a running
               loop) and a Python counter under threading.Lock
* bucket-64:   acquire(64), per token
* stats:       Counters.add / Histogram.record vs multiprocessing.Value under its lock
* json-scan:   scan_json (validate + find "model"/"stream") vs orjson.loads on OpenAI-style
               chat bodies of 48 B, 4 KB, 64 KB and 16 MiB (the last one a base64 image)

pytest-benchmark times one call of each benchmarked function; every call here does many
items (a loop in the function, the same loop shape for every contender), so the reported
times are per call and `extra_info` carries `items_per_call` and the per-item median in ns.
The native benchmark of each group runs last in its group and records `ratio_vs_<baseline>`
= baseline per-item median / native per-item median (> 1: native is faster).

Run: `.venv/bin/pytest --benchmark benches/bench_native.py` (run the whole file so that the
ratios can be computed).
"""

from __future__ import annotations

import asyncio
import base64
import multiprocessing
import queue
import random
import threading
from collections import deque
from collections.abc import Callable
from itertools import repeat
from typing import Any

import aiolimiter
import orjson
import pytest

from velox._native import JSON_OK, Counters, Histogram, Ring, scan_json
from velox_lab._bucket import TokenBucket

N = 1000  # items per call in the loop benchmarks
BATCH = 64
ROUNDS_PER_CALL = 16  # ring-batch: 16 x 64 items per call
DRAIN = 16384  # ring-drain: one full gateway-sized ring per call

# Per-item medians in ns, filled as the benchmarks run, for the ratios.
MEDIANS: dict[str, float] = {}


def record(benchmark: Any, name: str, items_per_call: int, note: str) -> float:
    per_item_ns = benchmark.stats.stats.median / items_per_call * 1e9
    MEDIANS[name] = per_item_ns
    benchmark.extra_info.update(
        {"items_per_call": items_per_call, "median_per_item_ns": round(per_item_ns, 2), "per": note}
    )
    return per_item_ns


def ratios(benchmark: Any, native: str, baselines: list[str]) -> None:
    for base in baselines:
        if base in MEDIANS:
            benchmark.extra_info[f"ratio_vs_{base}"] = round(MEDIANS[base] / MEDIANS[native], 2)


# ---------------------------------------------------------------- ring-pair


def _pair_loop(push: Callable[[object], object], pop: Callable[[], object]) -> Callable[[], None]:
    item = object()

    def run() -> None:
        for _ in repeat(None, N):
            push(item)
            pop()

    return run


def test_pair_deque(benchmark: Any) -> None:
    benchmark.group = "ring-pair: push+pop per item"
    dq: deque[object] = deque()
    benchmark(_pair_loop(dq.append, dq.popleft))
    record(benchmark, "deque", N, "append + popleft")


def test_pair_simplequeue(benchmark: Any) -> None:
    benchmark.group = "ring-pair: push+pop per item"
    sq: queue.SimpleQueue[object] = queue.SimpleQueue()
    benchmark(_pair_loop(sq.put_nowait, sq.get_nowait))
    record(benchmark, "simplequeue", N, "put_nowait + get_nowait")


def test_pair_asyncio_queue(benchmark: Any) -> None:
    benchmark.group = "ring-pair: push+pop per item"
    aq: asyncio.Queue[object] = asyncio.Queue()
    benchmark(_pair_loop(aq.put_nowait, aq.get_nowait))
    record(benchmark, "asyncio_queue", N, "put_nowait + get_nowait")


def test_pair_ring(benchmark: Any) -> None:
    benchmark.group = "ring-pair: push+pop per item"
    ring = Ring(16384)
    benchmark(_pair_loop(ring.try_push, ring.try_pop))
    record(benchmark, "ring_pair", N, "try_push + try_pop")
    ratios(benchmark, "ring_pair", ["deque", "simplequeue", "asyncio_queue"])
    assert len(ring) == 0


# ---------------------------------------------------------------- ring-batch


def test_batch_deque(benchmark: Any) -> None:
    benchmark.group = "ring-batch: 64 pushes + drain, per item"
    dq: deque[object] = deque()
    append, popleft, item = dq.append, dq.popleft, object()

    def run() -> None:
        for _ in repeat(None, ROUNDS_PER_CALL):
            for _ in repeat(None, BATCH):
                append(item)
            for _ in repeat(None, BATCH):
                popleft()

    benchmark(run)
    record(benchmark, "deque_batch", ROUNDS_PER_CALL * BATCH, "append + popleft, 64 at a time")


def test_batch_ring(benchmark: Any) -> None:
    benchmark.group = "ring-batch: 64 pushes + drain, per item"
    ring = Ring(16384)
    push, pop_batch, item = ring.try_push, ring.pop_batch, object()

    def run() -> None:
        for _ in repeat(None, ROUNDS_PER_CALL):
            for _ in repeat(None, BATCH):
                push(item)
            pop_batch(BATCH)

    benchmark(run)
    record(benchmark, "ring_batch", ROUNDS_PER_CALL * BATCH, "try_push + 1/64 pop_batch(64)")
    ratios(benchmark, "ring_batch", ["deque_batch"])
    assert len(ring) == 0


# ---------------------------------------------------------------- ring-drain


def test_drain_deque_popleft(benchmark: Any) -> None:
    benchmark.group = "ring-drain: consume a full 16384 queue, per item"
    dq: deque[object] = deque()
    items = [object()] * DRAIN

    def setup() -> tuple[tuple[()], dict[str, Any]]:
        dq.extend(items)
        return (), {}

    def run() -> None:
        popleft = dq.popleft
        for _ in repeat(None, DRAIN):
            popleft()

    benchmark.pedantic(run, setup=setup, rounds=300, warmup_rounds=5)
    record(benchmark, "deque_popleft", DRAIN, "popleft (timed: the drain only)")
    assert not dq


def test_drain_ring_pop_batch(benchmark: Any) -> None:
    benchmark.group = "ring-drain: consume a full 16384 queue, per item"
    ring = Ring(DRAIN)
    item = object()

    def setup() -> tuple[tuple[()], dict[str, Any]]:
        push = ring.try_push
        for _ in repeat(None, DRAIN):
            push(item)
        return (), {}

    def run() -> None:
        pop_batch = ring.pop_batch
        for _ in repeat(None, DRAIN // BATCH):
            pop_batch(BATCH)

    benchmark.pedantic(run, setup=setup, rounds=300, warmup_rounds=5)
    record(benchmark, "ring_pop_batch", DRAIN, "1/64 of pop_batch(64) (timed: the drain only)")
    ratios(benchmark, "ring_pop_batch", ["deque_popleft"])
    assert len(ring) == 0


# ---------------------------------------------------------------- bucket


class LockBucket:
    """What a pure-Python shared bucket looks like: a counter under threading.Lock."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.lock = threading.Lock()

    def acquire(self, n: int = 1) -> bool:
        with self.lock:
            if self.tokens >= n:
                self.tokens -= n
                return True
            return False


def test_bucket_lock_counter(benchmark: Any) -> None:
    benchmark.group = "bucket: uncontended acquire()"
    lb = LockBucket(10**15)
    acquire = lb.acquire

    def run() -> None:
        for _ in repeat(None, N):
            acquire()

    benchmark(run)
    record(benchmark, "lock_counter", N, "acquire() under threading.Lock")


def test_bucket_aiolimiter(benchmark: Any) -> None:
    benchmark.group = "bucket: uncontended acquire()"
    loop = asyncio.new_event_loop()
    try:
        limiter = aiolimiter.AsyncLimiter(max_rate=1e15, time_period=60)

        async def many() -> None:
            acquire = limiter.acquire
            for _ in repeat(None, N):
                await acquire()

        benchmark(lambda: loop.run_until_complete(many()))
    finally:
        loop.close()
    record(benchmark, "aiolimiter", N, "await acquire(), N per coroutine in a running loop")


def test_bucket_native_in_coroutine(benchmark: Any) -> None:
    """Same harness as aiolimiter (N calls inside one coroutine per run_until_complete), so
    the ratio to it compares the acquire calls and not the harness."""
    benchmark.group = "bucket: uncontended acquire()"
    bucket = TokenBucket(10**9, 10**9)
    loop = asyncio.new_event_loop()
    try:

        async def many() -> None:
            acquire = bucket.acquire
            for _ in repeat(None, N):
                acquire()

        benchmark(lambda: loop.run_until_complete(many()))
    finally:
        loop.close()
    record(benchmark, "native_acquire_coro", N,
           "acquire() in a coroutine, same harness as aiolimiter")
    ratios(benchmark, "native_acquire_coro", ["aiolimiter"])
    assert bucket.available() > 0  # never ran dry: the fast path was measured


def test_bucket_native(benchmark: Any) -> None:
    benchmark.group = "bucket: uncontended acquire()"
    bucket = TokenBucket(10**9, 10**9)
    acquire = bucket.acquire

    def run() -> None:
        for _ in repeat(None, N):
            acquire()

    benchmark(run)
    record(benchmark, "native_acquire", N, "acquire()")
    ratios(benchmark, "native_acquire", ["lock_counter", "aiolimiter"])
    assert bucket.available() > 0


def test_bucket_lock_counter_64(benchmark: Any) -> None:
    benchmark.group = "bucket-64: acquire(64), per token"
    lb = LockBucket(10**15)
    acquire = lb.acquire

    def run() -> None:
        for _ in repeat(None, N):
            acquire(64)

    benchmark(run)
    record(benchmark, "lock_counter64_per_token", N * 64, "token (acquire(64) / 64)")


def test_bucket_native_64(benchmark: Any) -> None:
    benchmark.group = "bucket-64: acquire(64), per token"
    admitted = [0, 0]

    def setup() -> tuple[tuple[TokenBucket], dict[str, Any]]:
        return (TokenBucket(10**9, 10**9),), {}  # fresh and full: 1.5e7 calls of headroom

    def run(bucket: TokenBucket) -> None:
        acquire = bucket.acquire
        ok = 0
        for _ in repeat(None, N):
            ok += acquire(64)
        admitted[0] += ok
        admitted[1] += N

    benchmark.pedantic(run, setup=setup, rounds=500, warmup_rounds=5)
    record(benchmark, "native_acquire64_per_token", N * 64, "token (acquire(64) / 64)")
    ratios(benchmark, "native_acquire64_per_token", ["lock_counter64_per_token"])
    assert admitted[0] == admitted[1]  # every call took the fast path


# ---------------------------------------------------------------- stats


@pytest.fixture(scope="module")
def mp_value() -> Any:
    return multiprocessing.get_context("fork").Value("q", 0)


def test_stats_mp_value(benchmark: Any, mp_value: Any) -> None:
    benchmark.group = "stats: shared increment"
    v = mp_value

    def run() -> None:
        for _ in repeat(None, N):
            with v.get_lock():
                v.value += 1

    benchmark(run)
    record(benchmark, "mp_value", N, "with v.get_lock(): v.value += 1")


def test_stats_counters_add(benchmark: Any) -> None:
    benchmark.group = "stats: shared increment"
    c = Counters(8, 4)
    add = c.add

    def run() -> None:
        for _ in repeat(None, N):
            add(3, 1)

    benchmark(run)
    record(benchmark, "counters_add", N, "Counters.add(slot, field)")
    ratios(benchmark, "counters_add", ["mp_value"])


def test_stats_histogram_record(benchmark: Any) -> None:
    benchmark.group = "stats: shared increment"
    h = Histogram(8)
    rec = h.record

    def run() -> None:
        for _ in repeat(None, N):
            rec(3, 12_345)

    benchmark(run)
    record(benchmark, "histogram_record", N, "Histogram.record(slot, value)")
    ratios(benchmark, "histogram_record", ["mp_value"])


# ---------------------------------------------------------------- json-scan


def chat_body(size: int) -> bytes:
    """An OpenAI-style chat request of exactly `size` bytes (deterministic). Small ones are
    conversations with some non-ASCII text; from 1 MiB on, the bulk is one base64 image in a
    data URL, which is what makes real bodies that large."""
    if size == 48:
        body = b'{"model":"gpt-4o","messages":[{"content":"hi"}]}'
        assert len(body) == 48
        return body
    rnd = random.Random(size)
    words = ["the", "model", "r\\u00e9ponse", "caf\u00e9", "naïve", "数据", "テスト", "🙂", "quick",
             "brown", "fox", "über", "Ελληνικά", "jumps", "over", "lazy", "dog", "42", "—"]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant. Réponds en français."}
    ]
    doc: dict[str, Any] = {"model": "gpt-4o", "messages": messages, "stream": True,
                           "temperature": 0.7, "max_tokens": 1024}
    if size >= 1 << 20:
        image = base64.b64encode(rnd.randbytes(size * 3 // 4)).decode()
        messages.append({"role": "user", "content": [
            {"type": "text", "text": "What is in this image? Décris-la."},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}},
        ]})
    else:
        while len(orjson.dumps(doc)) < size - 400:
            role = "user" if len(messages) % 2 else "assistant"
            text = " ".join(rnd.choice(words) for _ in range(rnd.randrange(10, 60)))
            messages.append({"role": role, "content": text})
        messages.append({"role": "user", "content": ""})
    # Trim (the image) or pad (the last message) to the exact size.
    body = orjson.dumps(doc)
    last = messages[-1]
    if len(body) > size:
        url = last["content"][1]["image_url"]
        url["url"] = url["url"][: len(url["url"]) - (len(body) - size)]
    else:
        last["content"] += "x" * (size - len(body))
    body = orjson.dumps(doc)
    assert len(body) == size, (len(body), size)
    return body


JSON_SIZES = {"48B": 48, "4KB": 4096, "64KB": 65536, "16MiB": 16 << 20}
# Bodies per benchmarked call, so that a call lasts well above the timer's resolution.
JSON_PER_CALL = {"48B": 1000, "4KB": 200, "64KB": 20, "16MiB": 1}


def _json_run(fn: Any, body: bytes, per_call: int) -> Any:
    def run() -> None:
        for _ in repeat(None, per_call):
            fn(body)

    return run


def _json_record(benchmark: Any, name: str, label: str, size: int, note: str) -> None:
    per_call = JSON_PER_CALL[label]
    ns = record(benchmark, name, per_call, note)
    benchmark.extra_info["body_bytes"] = size
    benchmark.extra_info["mb_per_s"] = round(size / ns * 1e3, 1)


@pytest.mark.parametrize("label", list(JSON_SIZES))
def test_json_orjson_loads(benchmark: Any, label: str) -> None:
    benchmark.group = f"json-scan: {label} chat body"
    size = JSON_SIZES[label]
    body = chat_body(size)
    benchmark(_json_run(orjson.loads, body, JSON_PER_CALL[label]))
    _json_record(benchmark, f"orjson_loads_{label}", label, size, "orjson.loads(body)")


@pytest.mark.parametrize("label", list(JSON_SIZES))
def test_json_scan_json(benchmark: Any, label: str) -> None:
    benchmark.group = f"json-scan: {label} chat body"
    size = JSON_SIZES[label]
    body = chat_body(size)
    assert scan_json(body)[0] == JSON_OK
    benchmark(_json_run(scan_json, body, JSON_PER_CALL[label]))
    name = f"scan_json_{label}"
    _json_record(benchmark, name, label, size, "scan_json(body)")
    base = f"orjson_loads_{label}"
    if base in MEDIANS:
        benchmark.extra_info["ratio_vs_orjson_loads"] = round(MEDIANS[base] / MEDIANS[name], 2)


# ---------------------------------------------------------------- C, no Python

# Row labels of native/tests/bench.c's table, and the key each figure is saved under.
C_ROWS = {
    "ring push + pop (one item, single thread)": "ring_push_pop",
    "ring pop, draining a full ring, per item": "ring_pop_drain",
    "ring pop_batch(64) claim, draining, per item": "ring_pop_batch_claim",
    "bucket acquire(1), uncontended": "bucket_acquire",
    "bucket acquire(64), uncontended, per token": "bucket_acquire64_per_token",
    "counters add (relaxed fetch_add)": "counters_add",
    "histogram record (3 relaxed fetch_adds)": "histogram_record",
    "ring push + pop, 2 threads sharing one ring, wall": "ring_push_pop_2_threads",
}


def test_c_core_ns_per_op(benchmark: Any) -> None:
    """native/tests/bench.c (built by `make -C native bench`, -O2): the primitives without
    Python, each figure the median of 7 runs inside the program."""
    import re
    import subprocess
    from pathlib import Path

    native = Path(__file__).resolve().parents[1] / "native"
    out: list[str] = []

    def run() -> None:
        done = subprocess.run(["make", "-s", "-C", str(native), "bench"], capture_output=True,
                              text=True, timeout=300, check=True)
        out.append(done.stdout)

    benchmark.group = "C core, no Python: ns per operation"
    benchmark.pedantic(run, rounds=1, iterations=1)
    figures = {}
    for line in out[-1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] in C_ROWS and re.fullmatch(r"[\d.]+", cells[1]):
            figures[C_ROWS[cells[0]]] = float(cells[1])
    assert set(figures) == set(C_ROWS.values()), out[-1]
    benchmark.extra_info.update({f"c_ns_{k}": v for k, v in figures.items()})
    print("\n" + out[-1])
