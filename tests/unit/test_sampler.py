"""The console's sampler on real shared memory (no sockets, an injected clock): rates per
interval, per worker (both physical slots of a logical one) and in total; latency quantiles of
the interval only; breaker transitions, an opening between two samples included."""

from __future__ import annotations

from typing import Any

from velox.admin.sampler import Sampler, window_quantiles
from velox.core.fields import F, H
from velox.state.stats import SharedStats


class Clock:
    t = 1_000.0

    def __call__(self) -> float:
        return self.t


class Health:
    """Stands in for SharedHealth.snapshot: the breaker rows the sampler reads."""

    def __init__(self, names: list[str]) -> None:
        self.rows = {n: {"state": "closed", "open_count": 0, "in_flight": 0} for n in names}

    def snapshot(self) -> dict[str, Any]:
        return {"upstreams": {n: dict(r) for n, r in self.rows.items()}}


def test_window_quantiles_only_count_what_was_added() -> None:
    before = {100: 1000}  # an hour of fast answers...
    now = {100: 1000, 5000: 10}  # ...then ten slow ones in this interval
    assert window_quantiles(now, before, (0.5, 0.99)) == [5000, 5000]
    assert window_quantiles(before, before, (0.5,)) == [0]


def test_rates_per_worker_and_total_from_one_interval() -> None:
    shared = SharedStats(2)
    clock = Clock()
    sampler = Sampler(shared, clock)
    assert sampler.take() is None  # the first reading only sets the baseline
    counters, hist = shared.counters, shared.histograms[H.TOTAL]
    counters.add(0, F.REQUESTS, 10)
    counters.add(2, F.REQUESTS, 10)  # logical worker 0 after a reload (physical slot 0 + 2)
    counters.add(1, F.REQUESTS, 20)
    counters.add(1, F.RESP_5XX, 5)
    counters.add(0, F.CACHE_HITS, 3)
    counters.add(0, F.CACHE_MISSES, 1)
    for _ in range(98):
        hist.record(1, 200)
    for _ in range(2):  # nearest rank: the 99th of 100 is the first slow one
        hist.record(1, 90_000)
    clock.t += 2.0
    sample = sampler.take()
    assert sample is not None
    total, (w0, w1) = sample["total"], sample["workers"]
    assert (total["rps"], w0["rps"], w1["rps"]) == (20.0, 10.0, 10.0)
    assert total["error_rate"] == 0.125 and w1["error_rate"] == 0.25 and w0["error_rate"] == 0
    assert w0["cache_hit_rate"] == 0.75 and w1["cache_hit_rate"] is None
    assert 199 <= w1["p50_us"] <= 203 and 89_000 <= w1["p99_us"] <= 91_000
    clock.t += 1.0
    quiet = sampler.take()
    assert quiet is not None and quiet["total"]["rps"] == 0 and quiet["total"]["p99_us"] == 0
    assert [s["t"] for s in sampler.since(clock.t - 0.5)] == [clock.t]


def test_transitions_including_an_opening_between_two_samples() -> None:
    shared = SharedStats(1)
    health = Health(["a", "b"])
    shared.health = health  # type: ignore[assignment]
    clock = Clock()
    sampler = Sampler(shared, clock)
    sampler.take()
    health.rows["a"].update(state="open", open_count=1)
    clock.t += 1
    sampler.take()
    health.rows["a"].update(state="closed")
    health.rows["b"].update(open_count=1)  # opened and half-opened and closed meanwhile
    clock.t += 1
    sampler.take()
    seen = [(t["upstream"], t["from"], t["to"]) for t in sampler.transitions]
    assert seen == [("a", "closed", "open"), ("a", "open", "closed"), ("b", "closed", "open"),
                    ("b", "open", "closed")]
