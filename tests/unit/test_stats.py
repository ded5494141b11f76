"""SharedStats across a reload: two slots per worker, the active mask, with_tables().

Socket-free: the shared mappings are real (native Counters/Histogram), nothing is forked.
"""

from __future__ import annotations

from velox.config.tables import UpstreamSpec, parse
from velox.core.fields import F, H
from velox.state.stats import SharedStats

TEMPLATE = UpstreamSpec("default", "https://api.openai.com")


def two_upstreams() -> object:
    data = {"upstream": [{"name": "a", "origin": "https://a.example"},
                         {"name": "b", "origin": "https://b.example"}],
            "route": [{"model": "m", "targets": [{"upstream": "b"}]}]}
    return parse(data, "test.toml", {}, TEMPLATE)


def test_two_slots_per_worker_and_the_first_half_active() -> None:
    shared = SharedStats(3)
    assert shared.slots == 6 and shared.counters.slots == 6
    assert shared.active_slots() == [0, 1, 2]
    assert [shared.is_active(s) for s in range(6)] == [True] * 3 + [False] * 3
    for slot in range(6):  # every slot has its own gauges and histogram rows
        shared.counters.set(slot, F.IN_FLIGHT, slot + 10)
        shared.histograms[H.TOTAL].record(slot, 100)
    assert [shared.counters.get(s, F.IN_FLIGHT) for s in range(6)] == list(range(10, 16))
    assert shared.histograms[H.TOTAL].count() == 6


def test_all_ready_looks_at_the_active_slots_only() -> None:
    shared = SharedStats(2)
    shared.counters.set(0, F.READY, 1)
    shared.counters.set(1, F.READY, 1)
    assert shared.all_ready()  # slots 2 and 3 (idle) do not count
    shared.active.set(0, 3, 1)
    shared.active.set(0, 1, 0)
    assert shared.active_slots() == [0, 3]
    assert not shared.all_ready()  # slot 3's worker is not ready yet
    shared.counters.set(3, F.READY, 1)
    assert shared.all_ready()


def test_with_tables_shares_the_worker_state_and_makes_new_upstream_parts() -> None:
    old = SharedStats(2)
    old.counters.add(1, F.REQUESTS, 7)
    old.upstream_status.add(0, 0, 5)
    new = old.with_tables(two_upstreams())  # type: ignore[arg-type]
    # Worker counters, histograms, routes, retries and the mask are the same mappings.
    for name in ("counters", "histograms", "routes", "retries", "active"):
        assert getattr(new, name) is getattr(old, name), name
    assert new.counters.get(1, F.REQUESTS) == 7
    new.counters.add(3, F.REQUESTS, 1)
    assert old.counters.totals()[F.REQUESTS] == 8
    new.active.set(0, 2, 1)
    assert old.is_active(2)
    # Per-upstream parts follow the new tables, from zero; the old ones are untouched.
    assert new.health.names == ("a", "b") and old.health.names == ("default",)
    assert len(new.upstream_latency) == 2 and len(old.upstream_latency) == 1
    assert new.target_names == (("m", "b"),)
    assert sum(new.upstream_status.totals()) == 0 and sum(old.upstream_status.totals()) == 5
    assert new.upstream_status.slots == 4 and new.targets.slots == 4
