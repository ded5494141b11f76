"""The request path's spend pieces without sockets: the budgets' shared counters (reserve,
settle, a killed worker's reservations, a new period, the ledger's base after a restart),
the fast cost against the reference arithmetic, the USD text, the UTC periods."""

from __future__ import annotations

import datetime as dt
import random
from pathlib import Path

from velox.config.tables import BudgetSpec, KeySpec, RouteSpec, Tables, TargetSpec, UpstreamSpec
from velox.spend.ledger import LedgerWriter, make_row
from velox.spend.prices import PriceTable, cost_nanos
from velox.spend.wire import SharedBudgets, _Usage, period_number, plain_cost, usd_text

SHA = "0" * 64


def tables(*keys: KeySpec, budgets: tuple[BudgetSpec, ...] = ()) -> Tables:
    return Tables(upstreams=(UpstreamSpec("default", "https://example.com"),),
                  routes=(RouteSpec("*", (TargetSpec("default"),)),), keys=keys,
                  budgets=budgets)


def test_plain_cost_is_the_reference_cost_for_every_shipped_price() -> None:
    rng = random.Random(7)
    for spec in PriceTable().entries:
        for _ in range(20):
            inp, out = rng.randrange(0, 10**7), rng.randrange(0, 10**6)
            assert plain_cost(spec, inp, out) == cost_nanos(spec, _Usage(inp, out)), spec


def test_usd_text() -> None:
    assert usd_text(0) == b"0"
    assert usd_text(1) == b"0.000000001"
    assert usd_text(1_100_000) == b"0.0011"
    assert usd_text(12 * 10**9) == b"12"
    assert usd_text(10**9 + 5) == b"1.000000005"


def test_periods_are_utc_calendar_periods() -> None:
    def at(text: str) -> float:
        return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC).timestamp()

    assert period_number("day", at("2026-11-26T23:59:59")) + 1 == \
        period_number("day", at("2026-11-27T00:00:00"))
    # ISO weeks start on Monday (2026-11-30 is one).
    assert period_number("week", at("2026-11-29T23:59:59")) + 1 == \
        period_number("week", at("2026-11-30T00:00:00"))
    assert period_number("week", at("2026-11-30T00:00:00")) == \
        period_number("week", at("2026-12-06T23:59:59"))
    assert period_number("month", at("2026-12-31T23:59:59")) + 1 == \
        period_number("month", at("2027-01-01T00:00:00"))
    assert period_number("total", at("2026-01-01T00:00:00")) == \
        period_number("total", at("2036-01-01T00:00:00"))


def test_reserve_settle_and_a_killed_workers_reservations() -> None:
    # $0.001: 1,000 units of one micro-USD in a native bucket.
    shared = SharedBudgets(tables(KeySpec("a", SHA, budget_nanos=10**6, budget_period="day")),
                           slots=2)
    assert shared.units == (1000,) and shared.sizes == (1000,)
    assert shared.left(0) == 10**6 and shared.used(0) == 0
    shared.reserve(0, 0, 300)
    shared.reserve(1, 0, 200)
    assert shared.used(0) == 500_000 and shared.reserved(0) == 500_000
    shared.settle(0, 0, 300, 120)  # exact cost below the estimate: the rest goes back
    assert shared.used(0) == 320_000 and shared.reserved(0) == 200_000
    # Slot 1's worker dies holding its reservation; the next one there gives it back.
    shared.start_slot(1)
    assert shared.used(0) == 120_000 and shared.reserved(0) == 0
    shared.settle(0, 0, 0, 50)  # a cost with nothing reserved (an unpriced estimate)
    assert shared.used(0) == 170_000
    # Admitted while anything is left: an estimate larger than what is left goes into debt,
    # and the exact cost settles it.
    shared.reserve(0, 0, 2000)
    assert shared.left(0) == (1000 - 170 - 2000) * 1000
    shared.settle(0, 0, 2000, 900)
    assert shared.used(0) == 1_070_000 and shared.left(0) == -70_000


def test_a_budget_above_a_thousand_dollars_counts_coarser_units() -> None:
    shared = SharedBudgets(tables(KeySpec("a", SHA, budget_nanos=10**15, budget_period="total")),
                           slots=1)
    assert shared.units == (10**6,) and shared.sizes == (10**9,)  # $1M in milli-dollars
    assert shared.left(0) == 10**15


def test_a_new_period_fills_the_budget_again() -> None:
    now = dt.datetime(2026, 11, 26, 23, 59, 59, tzinfo=dt.UTC).timestamp()
    shared = SharedBudgets(tables(KeySpec("a", SHA, budget_nanos=10**6, budget_period="day")),
                           slots=2, now_s=now)
    shared.reserve(0, 0, 100)
    shared.settle(0, 0, 100, 400)  # spent 400 units
    shared.reserve(0, 0, 70)  # one in flight
    assert shared.roll(now + 0.5) == []  # the same day: nothing moves
    assert shared.used(0) == 470_000
    assert shared.roll(now + 1) == [0]  # midnight UTC
    assert shared.used(0) == 0 and shared.left(0) == 10**6
    shared.settle(0, 0, 70, 90)  # the request in flight: its cost beyond its reservation
    assert shared.used(0) == 20_000
    assert shared.roll(now + 2) == []


def test_a_restart_resumes_from_the_ledger(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    writer = LedgerWriter(path)
    writer.start()
    now_ms = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    writer.submit([make_row(ts_ms=now_ms, key="a", team="t", cost_nanos=700_000),
                   make_row(ts_ms=now_ms, key="b", team="t", cost_nanos=50_000),
                   make_row(ts_ms=now_ms - 40 * 86_400_000, key="a", team="t",
                            cost_nanos=9_000)])
    writer.close()
    spec = tables(KeySpec("a", SHA, budget_nanos=10**7, budget_period="day"),
                  KeySpec("b", "1" * 64),
                  budgets=(BudgetSpec("t", 10**8, "total", ("a", "b")),))
    shared = SharedBudgets(spec, slots=2, ledger_file=str(path))
    assert [b.name for b in shared.budgets] == ["a", "t"]
    assert shared.used(0) == 700_000  # today's spend of key a
    assert shared.used(1) == 759_000  # team t, ever
    fresh = SharedBudgets(spec, slots=2, ledger_file=str(tmp_path / "none.sqlite3"))
    assert fresh.used(0) == 0
