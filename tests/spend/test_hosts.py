"""The refresher's side of budgets across hosts (velox.spend.hosts), without Redis: what a
host reports as used, what it asks for, its outage share, a period's roll, its leaving."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from tests.spend.test_wire import SHA, tables
from velox.config.tables import KeySpec
from velox.spend.gate import GateTwin
from velox.spend.hosts import BudgetLeases, allowance_cap, bound, host_id
from velox.spend.wire import SharedBudgets

NOON = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC).timestamp()


def leased(units: int = 10**6) -> SharedBudgets:
    """One key's budget of `units` micro-dollars, held across hosts (leased)."""
    spec = tables(KeySpec("a", SHA, budget_nanos=units * 1000, budget_period="day"))
    return SharedBudgets(spec, slots=2, now_s=NOON, leased=True)


def test_a_leased_budget_starts_empty_and_does_not_roll_itself() -> None:
    shared = leased()
    assert shared.limits.level(0) == 0
    assert shared.unallocated(0) == 10**6 * 1000  # what a lone host would have
    assert shared.roll(NOON + 86_400) == []  # the refresher rolls it


def test_used_is_what_was_given_less_what_is_held() -> None:
    shared = leased()
    host = BudgetLeases(shared, "h")
    host.states[0].given += shared.limits.give(0, 500)
    slot0, slot1 = (GateTwin(shared.limits, shared.in_flight, shared.units, s) for s in (0, 1))
    assert shared.units == (1000,)
    slot0.reserve(0, 120)  # a request in flight reserves 120
    assert host.used(0) == 120
    slot0.settle((0,), 120_000, 30_000)  # it cost 30
    assert host.used(0) == 30
    slot1.reserve(0, 600)  # admitted while anything was left: into debt
    assert host.used(0) == 630 and shared.limits.level(0) == -130


def test_a_refused_request_is_demand_the_host_asks_for() -> None:
    shared = leased()
    host = BudgetLeases(shared, "h")
    host._roll(NOON)
    assert host._plan(1.0, hosts=3) == [1]  # nothing asked yet: one unit
    assert shared.limits.take(0, 400) != 0  # what admission does for a refused request
    # 400 refused in a tick (0.05 s) is 8,000 a second: the ask is a second of that, below
    # the cap (5% of 1,000,000 over 3 hosts: 16,667)
    assert host._plan(1.05, hosts=3) == [8000]
    # The demand gone, the request's estimate is still asked (it decays with a half-life of
    # 10 s: 0.05 s later, 399 of 400).
    host.states[0].rate_est = 0.0
    assert host._plan(1.10, hosts=3) == [399]


def test_an_outage_gives_the_host_its_share_of_what_was_left() -> None:
    shared = leased()
    host = BudgetLeases(shared, "h")
    shared.across.set(0, 0, 900)  # Redis last said 900 units were left unallocated
    host.down(hosts=3)
    assert shared.limits.level(0) == 300 and host.states[0].given == 300
    assert shared.unallocated(0) == 0  # the rest is the other hosts'


def test_a_new_period_takes_the_allowance_back_and_starts_from_zero() -> None:
    shared = leased()
    host = BudgetLeases(shared, "h")
    assert host._roll(NOON)
    key = host.states[0].key
    assert key == "velox:budget:key:a:day:2026-11-26"
    host.states[0].given += shared.limits.give(0, 500)
    worker = GateTwin(shared.limits, shared.in_flight, shared.units, 0)
    worker.reserve(0, 200)
    worker.settle((0,), 200_000, 200_000)
    assert host.used(0) == 200
    assert not host._roll(NOON + 3600)
    assert host._roll(NOON + 86_400)
    assert host.states[0].key == "velox:budget:key:a:day:2026-11-27"
    assert shared.limits.level(0) == 0 and host.used(0) == 0


def test_the_host_id_is_kept_beside_the_ledger(tmp_path: Path) -> None:
    ledger = str(tmp_path / "ledger.sqlite3")
    first = host_id(ledger)
    assert len(first) == 16 and host_id(ledger) == first
    assert host_id("") != host_id("")  # no ledger: a new name each start


def test_the_stated_bound() -> None:
    assert allowance_cap(40_000, 1) == 2_000 and allowance_cap(40_000, 4) == 500
    # two requests in flight of at most 360 units, an allowance (the cap) per host
    assert bound(40_000, 3, 360, 2) == 720 + 2 * 3 * 2_000
    assert bound(40_000, 3, 360, 2, estimate=3_840, outage=True) == 720 + 4 * 3 * 3_840


def test_a_host_with_nothing_held_borrows_one_estimate_while_redis_had_room() -> None:
    shared = leased()
    shared.across.set(0, 0, 5_000)  # 5,000 units ($0.005) left unallocated at the last call
    assert shared.may_borrow(0, 0, 4_000_000)  # nothing held, an estimate of 4,000 units
    assert shared.may_borrow(0, -3_000_000, 4_000_000)  # a debt under one estimate
    assert not shared.may_borrow(0, -4_000_000, 4_000_000)  # a whole estimate owed already
    assert not shared.may_borrow(0, 0, 6_000_000)  # more than Redis said was left
    assert not shared.may_borrow(0, 0, 0)  # unpriced: nothing to borrow against
