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
    shared = SharedBudgets(tables(KeySpec("a", SHA, budget_nanos=1000, budget_period="day")),
                           slots=2)
    shared.reserve(0, 0, 300)
    shared.reserve(1, 0, 200)
    assert shared.used(0) == 500
    shared.charge(0, 0, 300, 120)  # exact cost below the estimate: the rest goes back
    assert shared.used(0) == 320
    # Slot 1's worker dies holding its reservation; the next one there drops it.
    shared.start_slot(1)
    assert shared.used(0) == 120
    shared.charge(0, 0, 0, 50)  # a cost with nothing reserved (unbudgeted estimate)
    assert shared.used(0) == 170


def test_a_new_period_drops_the_old_spend_but_not_reservations() -> None:
    shared = SharedBudgets(tables(KeySpec("a", SHA, budget_nanos=1000, budget_period="day")),
                           slots=2)
    shared.reserve(0, 0, 100)
    shared.charge(0, 0, 100, 400)  # spent 400
    shared.reserve(0, 0, 70)  # one in flight
    day = period_number("day", dt.datetime.now(dt.UTC).timestamp())
    shared.roll(0, {"day": day, "week": 0, "month": 0, "total": 0})
    assert shared.used(0) == 470  # same period: nothing moves
    shared.roll(0, {"day": day + 1, "week": 0, "month": 0, "total": 0})
    assert shared.used(0) == 70  # the reservation in flight stays


def test_a_restart_resumes_from_the_ledger(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    writer = LedgerWriter(path)
    writer.start()
    now_ms = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    writer.submit([make_row(ts_ms=now_ms, key="a", team="t", cost_nanos=700),
                   make_row(ts_ms=now_ms, key="b", team="t", cost_nanos=50),
                   make_row(ts_ms=now_ms - 40 * 86_400_000, key="a", team="t", cost_nanos=9)])
    writer.close()
    spec = tables(KeySpec("a", SHA, budget_nanos=1000, budget_period="day"),
                  KeySpec("b", "1" * 64),
                  budgets=(BudgetSpec("t", 10_000, "total", ("a", "b")),))
    shared = SharedBudgets(spec, slots=2, ledger_file=str(path))
    assert [b.name for b in shared.budgets] == ["a", "t"]
    assert shared.used(0) == 700  # today's spend of key a
    assert shared.used(1) == 759  # team t, ever
    fresh = SharedBudgets(spec, slots=2, ledger_file=str(tmp_path / "none.sqlite3"))
    assert fresh.used(0) == 0
