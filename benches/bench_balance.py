"""Routing decisions: what choosing a target costs, and how the two consistent hashes compare.

Timed (pytest-benchmark; every call does N = 1,000 items, figures are per item):

* select:   one request's whole balancing work against the real shared state
            (velox.state.health.SharedHealth): router.plan() + plan.first() + plan.finish(), for
            weighted, least_busy and hash (rendezvous and ring), 3 targets; 100 requests per
            call. Target < 2 us.
* breaker:  SharedHealth.check() (breaker peek + in-flight cap), and admit() + finish().
* lookup:   hash64 of a 36-byte key; rendezvous first()/rank() and ring first()/rank() over
            3 and 10 targets, on a precomputed key hash.
* reference: TokenBucket.acquire() in the same loop, whose quiet-machine figure is known
            (13.6 ns, native/README.md). This 2-core machine is shared and its speed varies
            several-fold with the load, so balance.json also gives each minimum as a multiple
            of the reference's minimum and the figure that multiple implies on a quiet machine.

Not timed by pytest-benchmark, computed once (test_hash_quality): for 3 and 10 equal targets
and 100,000 keys, each method's balance (max / mean keys per target), the share of keys that
move when a target is removed and when one is added (ideal: 1/n and 1/(n+1)), and lookup cost
from a perf_counter loop. The table, with the medians of the timed groups, goes to
benches/results/balance.json (or $VELOX_BENCH_RESULTS).

Run: `.venv/bin/pytest --benchmark benches/bench_balance.py` (the whole file, so the JSON gets
every figure).
"""

from __future__ import annotations

import bisect
import json
import os
import time
from collections import Counter
from itertools import repeat
from pathlib import Path
from typing import Any

from velox._native import Rendezvous, hash64
from velox.config.tables import RouteSpec, Tables, TargetSpec, UpstreamSpec
from velox.core.clock import now_ms
from velox.routing.balance import Router, target_seed
from velox.state.health import SUCCESS, SharedHealth
from velox_lab._bucket import TokenBucket

N = 1000
KEYS = 100_000
TARGET_NS = 2000
REFERENCE_QUIET_NS = 13.6  # TokenBucket.acquire() from Python, quiet machine (native/README.md)
RESULTS = Path(__file__).parent / "results"
SELECT_N = 100  # requests per call of the select group: short calls, rarely descheduled
MEDIANS: dict[str, float] = {}
MINIMA: dict[str, float] = {}
RING_VNODES = 150  # virtual nodes per unit of weight on the ring (the seed's figure)
HASH_METHOD = "rendezvous"  # the one the gateway uses


class HashRing:
    """Consistent hashing with virtual nodes (RING_VNODES per unit of weight), as the seed
    describes: the gateway hashes by rendezvous (velox.routing.balance), and this is what it
    was chosen over, kept here for the comparison."""

    __slots__ = ("points", "owners", "n")

    def __init__(self, seeds: list[int], weights: list[int], vnodes: int = RING_VNODES) -> None:
        pairs = sorted(
            (hash64(b"%d#%d" % (seed, v)), i)
            for i, (seed, w) in enumerate(zip(seeds, weights, strict=True))
            for v in range(vnodes * w)
        )
        self.points = [p for p, _ in pairs]
        self.owners = [i for _, i in pairs]
        self.n = len(seeds)

    def first(self, key_hash: int) -> int:
        i = bisect.bisect(self.points, key_hash)
        return self.owners[i if i < len(self.owners) else 0]

    def rank(self, key_hash: int) -> tuple[int, ...]:
        """Distinct targets met walking clockwise from the key."""
        owners = self.owners
        size = len(owners)
        start = bisect.bisect(self.points, key_hash)
        seen: list[int] = []
        for k in range(size):
            o = owners[(start + k) % size]
            if o not in seen:
                seen.append(o)
                if len(seen) == self.n:
                    break
        return tuple(seen)


def _with_ring(router: Router) -> Router:
    """The router with every tier's rendezvous hasher replaced by a HashRing of the same
    targets and weights (the ring row of the select group)."""
    for chain in router.chains.values():
        for picker in chain:
            for tier in picker.tiers:
                tier.hasher = HashRing([target_seed(t.spec) for t in tier.targets],  # type: ignore[assignment]
                                       [t.weight for t in tier.targets])
    return router


def record(benchmark: Any, name: str, note: str, items: int = N) -> float:
    """Per-item median and minimum. On this shared machine a call is often descheduled
    part-way; the minimum over many short calls is the figure least disturbed by that."""
    stats = benchmark.stats.stats
    per_item_ns = stats.median / items * 1e9
    MEDIANS[name] = round(per_item_ns, 1)
    MINIMA[name] = round(stats.min / items * 1e9, 1)
    benchmark.extra_info.update(
        {"items_per_call": items, "median_per_item_ns": round(per_item_ns, 2),
         "min_per_item_ns": MINIMA[name], "per": note})
    return per_item_ns


def _tables(strategy: str, n: int = 3) -> Tables:
    ups = tuple(UpstreamSpec(f"u{i}", f"https://u{i}.test") for i in range(n))
    route = RouteSpec("m", tuple(TargetSpec(f"u{i}") for i in range(n)), strategy)
    return Tables(ups, (route,))


def _select(benchmark: Any, strategy: str, key: bytes | None, method: str = HASH_METHOD) -> None:
    tables = _tables(strategy)
    state = SharedHealth.create(tables)
    router = Router(tables, state)
    if method == "ring":
        _with_ring(router)
    plan_of = router.plan

    def run() -> None:
        for _ in repeat(None, SELECT_N):
            plan = plan_of("m", key)
            attempt = plan.first()  # type: ignore[union-attr]
            plan.finish(attempt, SUCCESS)  # type: ignore[union-attr, arg-type]

    benchmark(run)
    assert all(state.in_flight(u) == 0 for u in range(3))


def test_reference_bucket_acquire(benchmark: Any) -> None:
    benchmark.group = "reference"
    acquire = TokenBucket(10**9, 10**9).acquire

    def run() -> None:
        for _ in repeat(None, N):
            acquire()

    benchmark(run)
    record(benchmark, "reference_bucket_acquire", "acquire")


def test_select_weighted(benchmark: Any) -> None:
    benchmark.group = "select: plan + first + finish, 3 targets"
    _select(benchmark, "weighted", None)
    record(benchmark, "select_weighted", "request", SELECT_N)


def test_select_least_busy(benchmark: Any) -> None:
    benchmark.group = "select: plan + first + finish, 3 targets"
    _select(benchmark, "least_busy", None)
    record(benchmark, "select_least_busy", "request", SELECT_N)


def test_select_hash_rendezvous(benchmark: Any) -> None:
    benchmark.group = "select: plan + first + finish, 3 targets"
    _select(benchmark, "hash", b"0b7c9e4e-6a0f-4c55-9d6e-1f2a3b4c5d6e", "rendezvous")
    record(benchmark, "select_hash_rendezvous", "request", SELECT_N)


def test_select_hash_ring(benchmark: Any) -> None:
    benchmark.group = "select: plan + first + finish, 3 targets"
    _select(benchmark, "hash", b"0b7c9e4e-6a0f-4c55-9d6e-1f2a3b4c5d6e", "ring")
    record(benchmark, "select_hash_ring", "request", SELECT_N)


def test_breaker_check(benchmark: Any) -> None:
    benchmark.group = "breaker"
    state = SharedHealth.create(_tables("weighted"))
    check, t = state.check, now_ms()

    def run() -> None:
        for _ in repeat(None, N):
            check(0, t)

    benchmark(run)
    record(benchmark, "breaker_check", "check")


def test_admit_finish(benchmark: Any) -> None:
    benchmark.group = "breaker"
    state = SharedHealth.create(_tables("weighted"))
    admit, finish, t = state.allow, state.finish, now_ms()

    def run() -> None:
        for _ in repeat(None, N):
            finish(0, admit(0, t), SUCCESS, t)

    benchmark(run)
    record(benchmark, "admit_finish", "admit + finish")


def test_hash64(benchmark: Any) -> None:
    benchmark.group = "lookup"
    key = b"0b7c9e4e-6a0f-4c55-9d6e-1f2a3b4c5d6e"

    def run() -> None:
        for _ in repeat(None, N):
            hash64(key)

    benchmark(run)
    record(benchmark, "hash64_36B", "hash")


def _seeds(n: int) -> list[int]:
    return [hash64(b"upstream-%d\x00" % i) for i in range(n)]


def _hashers(n: int) -> dict[str, Any]:
    seeds = _seeds(n)
    return {"rendezvous": Rendezvous(seeds, [1.0] * n), "ring": HashRing(seeds, [1] * n)}


def _lookup(benchmark: Any, method: str, n: int, op: str) -> None:
    benchmark.group = "lookup"
    fn = getattr(_hashers(n)[method], op)
    key = hash64(b"session-123")

    def run() -> None:
        for _ in repeat(None, N):
            fn(key)

    benchmark(run)
    record(benchmark, f"{method}_{op}_{n}", "lookup")


def test_lookup_rendezvous_first_3(benchmark: Any) -> None:
    _lookup(benchmark, "rendezvous", 3, "first")


def test_lookup_rendezvous_first_10(benchmark: Any) -> None:
    _lookup(benchmark, "rendezvous", 10, "first")


def test_lookup_rendezvous_rank_10(benchmark: Any) -> None:
    _lookup(benchmark, "rendezvous", 10, "rank")


def test_lookup_ring_first_3(benchmark: Any) -> None:
    _lookup(benchmark, "ring", 3, "first")


def test_lookup_ring_first_10(benchmark: Any) -> None:
    _lookup(benchmark, "ring", 10, "first")


def test_lookup_ring_rank_10(benchmark: Any) -> None:
    _lookup(benchmark, "ring", 10, "rank")


# ------------------------------------------------------------------------------ quality


def _owners(hasher: Any, keys: list[int]) -> list[int]:
    first = hasher.first
    return [first(k) for k in keys]


def _quality(method: str, n: int, keys: list[int]) -> dict[str, Any]:
    seeds = _seeds(n + 1)

    def build(count: int) -> Any:
        s = seeds[:count]
        if method == "rendezvous":
            return Rendezvous(s, [1.0] * count)
        return HashRing(s, [1] * count)

    base = build(n)
    owners = _owners(base, keys)
    counts = Counter(owners)
    mean = len(keys) / n
    removed = _owners(build(n - 1), keys)  # the last target removed
    added = _owners(build(n + 1), keys)
    moved_remove = sum(a != b for a, b in zip(owners, removed, strict=False))
    moved_add = sum(a != b for a, b in zip(owners, added, strict=False))
    # Only keys of the removed target should move; only keys to the new one.
    wrong_remove = sum(a != b and a != n - 1 for a, b in zip(owners, removed, strict=False))
    wrong_add = sum(a != b and b != n for a, b in zip(owners, added, strict=False))
    first = base.first
    t0 = time.perf_counter_ns()
    for k in keys:
        first(k)
    lookup_ns = (time.perf_counter_ns() - t0) / len(keys)
    return {
        "method": method, "targets": n, "keys": len(keys),
        "max_over_mean": round(max(counts.values()) / mean, 4),
        "min_over_mean": round(min(counts.values()) / mean, 4),
        "moved_on_remove": round(moved_remove / len(keys), 4),
        "ideal_on_remove": round(1 / n, 4),
        "moved_elsewhere_on_remove": wrong_remove,
        "moved_on_add": round(moved_add / len(keys), 4),
        "ideal_on_add": round(1 / (n + 1), 4),
        "moved_between_old_on_add": wrong_add,
        "lookup_ns": round(lookup_ns, 1),
    }


def _weighted_share(method: str, keys: list[int]) -> float:
    seeds = _seeds(2)
    h = Rendezvous(seeds, [3.0, 1.0]) if method == "rendezvous" else HashRing(seeds, [3, 1])
    return round(Counter(_owners(h, keys))[0] / len(keys), 4)


def _estimates() -> dict[str, float]:
    """Each minimum as a multiple of the reference's minimum, times the reference's quiet
    figure: an estimate of the figure on a quiet machine."""
    ref = MINIMA.get("reference_bucket_acquire")
    if not ref:
        return {}
    return {name: round(ns / ref * REFERENCE_QUIET_NS, 1) for name, ns in sorted(MINIMA.items())}


def test_hash_quality() -> None:
    keys = [hash64(b"key-%d" % i) for i in range(KEYS)]
    rows = [_quality(m, n, keys) for n in (3, 10) for m in ("rendezvous", "ring")]
    shares = {m: _weighted_share(m, keys) for m in ("rendezvous", "ring")}
    for row in rows:
        print(row)
        if row["method"] == "rendezvous":  # exact minimal movement
            assert row["moved_elsewhere_on_remove"] == 0 and row["moved_between_old_on_add"] == 0
    print("3:1 weighted share of the heavier target:", shares)
    doc = {
        "kind": "velox-balance",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg": list(os.getloadavg()),
        "hash_used": HASH_METHOD,
        "hash_quality": rows,
        "weighted_3_to_1_share": shares,
        "timed_medians_ns_per_item": dict(sorted(MEDIANS.items())),
        "timed_minima_ns_per_item": dict(sorted(MINIMA.items())),
        "target_ns": TARGET_NS,
        "reference": "reference_bucket_acquire",
        "reference_quiet_ns": REFERENCE_QUIET_NS,
        "quiet_estimate_ns_per_item": _estimates(),
    }
    outdir = Path(os.environ.get("VELOX_BENCH_RESULTS") or RESULTS)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "balance.json").write_text(json.dumps(doc, indent=1) + "\n")
