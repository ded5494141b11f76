"""The request path's spend pieces without sockets: the budgets' shared counters (reserve,
settle, a killed worker's reservations, a new period, the ledger's base after a restart),
the fast cost against the reference arithmetic, the USD text, the UTC periods."""

from __future__ import annotations

import datetime as dt
import random
from pathlib import Path

import pytest

from velox.config.tables import BudgetSpec, KeySpec, RouteSpec, Tables, TargetSpec, UpstreamSpec
from velox.spend.gate import BudgetGate, GateTwin, usd_text
from velox.spend.ledger import LedgerWriter, make_row
from velox.spend.prices import PriceTable, cost_nanos
from velox.spend.wire import SharedBudgets, _Usage, period_number, plain_cost

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


GATES = pytest.mark.parametrize("gate", [BudgetGate, GateTwin], ids=["native", "twin"])


@GATES
def test_reserve_settle_and_a_killed_workers_reservations(gate: type[BudgetGate]) -> None:
    # $0.001: 1,000 units of one micro-USD in a native bucket.
    shared = SharedBudgets(tables(KeySpec("a", SHA, budget_nanos=10**6, budget_period="day")),
                           slots=2)
    assert shared.units == (1000,) and shared.sizes == (1000,)
    slot0, slot1 = (gate(shared.limits, shared.in_flight, shared.units, s) for s in (0, 1))
    assert shared.left(0) == 10**6 and shared.used(0) == 0
    assert slot0.admit((0,), 300_000) == b"0.001"  # what was left before it
    assert slot1.admit((0,), 199_001) == b"0.0007"  # reserves whole units: 200
    assert shared.used(0) == 500_000 and shared.reserved(0) == 500_000
    slot0.settle((0,), 300_000, 120_000)  # exact cost below the estimate: the rest goes back
    assert shared.used(0) == 320_000 and shared.reserved(0) == 200_000
    # Slot 1's worker dies holding its reservation; the next one there gives it back.
    shared.start_slot(1)
    assert shared.used(0) == 120_000 and shared.reserved(0) == 0
    slot0.settle((0,), 0, 50_400)  # a cost with nothing reserved (an unpriced estimate)
    assert shared.used(0) == 170_000 and tuple(slot0.carry) == (400,)  # below a unit: kept
    # Admitted while anything is left: an estimate larger than what is left goes into debt,
    # and the exact cost settles it (with the carry).
    assert slot0.admit((0,), 2_000_000) == b"0.00083"
    assert shared.left(0) == (1000 - 170 - 2000) * 1000
    slot0.settle((0,), 2_000_000, 899_600)
    assert shared.used(0) == 1_070_000 and shared.left(0) == -70_000
    assert tuple(slot0.carry) == (0,)
    assert slot0.admit((0,), 1000) == 0  # nothing left: refused by budget 0, nothing taken
    assert shared.used(0) == 1_070_000 and shared.reserved(0) == 0


def test_the_native_gate_does_what_its_twin_does() -> None:
    """Random admissions and settlements over a key's own budget, a team's and a coarse one
    (a unit of 10**6 nano-USD), through two slots: the native gate and its Python twin,
    each on its own copy of the budgets, answer and leave the same state at every step."""
    spec = tables(KeySpec("a", SHA, budget_nanos=3 * 10**6, budget_period="day"),
                  KeySpec("b", "1" * 64, budget_nanos=2 * 10**15, budget_period="total"),
                  budgets=(BudgetSpec("t", 5 * 10**6, "month", ("a", "b")),))
    rng = random.Random(20)
    copies = [SharedBudgets(spec, slots=2) for _ in range(2)]
    gates = [[kind(c.limits, c.in_flight, c.units, s) for s in (0, 1)]
             for kind, c in zip((BudgetGate, GateTwin), copies, strict=True)]
    held: list[tuple[int, tuple[int, ...], int]] = []
    for _ in range(3000):
        if held and rng.random() < 0.5:
            slot, budgets, estimate = held.pop(rng.randrange(len(held)))
            cost = rng.choice((0, rng.randrange(10**6), rng.randrange(3 * 10**6)))
            for g in gates:
                g[slot].settle(budgets, estimate, cost)
        else:
            slot = rng.randrange(2)
            budgets = rng.choice(((0, 2), (1, 2), (2,), (0,), (1,)))
            estimate = rng.choice((0, rng.randrange(1, 10**5), rng.randrange(10**6)))
            native, twin = (g[slot].admit(budgets, estimate) for g in gates)
            assert native == twin
            if type(native) is bytes:
                held.append((slot, budgets, estimate))
        levels = [[c.limits.level(b) for b in range(3)] for c in copies]
        assert levels[0] == levels[1]
        assert copies[0].in_flight.snapshot() == copies[1].in_flight.snapshot()
        assert [tuple(g.carry) for g in gates[0]] == [tuple(g.carry) for g in gates[1]]
    assert any(level < 0 for level in levels[0])  # the budgets went into debt and back


def test_a_budget_above_a_thousand_dollars_counts_coarser_units() -> None:
    shared = SharedBudgets(tables(KeySpec("a", SHA, budget_nanos=10**15, budget_period="total")),
                           slots=1)
    assert shared.units == (10**6,) and shared.sizes == (10**9,)  # $1M in milli-dollars
    assert shared.left(0) == 10**15


@GATES
def test_a_new_period_fills_the_budget_again(gate: type[BudgetGate]) -> None:
    now = dt.datetime(2026, 11, 26, 23, 59, 59, tzinfo=dt.UTC).timestamp()
    shared = SharedBudgets(tables(KeySpec("a", SHA, budget_nanos=10**6, budget_period="day")),
                           slots=2, now_s=now)
    worker = gate(shared.limits, shared.in_flight, shared.units, 0)
    worker.admit((0,), 100_000)
    worker.settle((0,), 100_000, 400_000)  # spent 400 units
    worker.admit((0,), 70_000)  # one in flight
    assert shared.roll(now + 0.5) == []  # the same day: nothing moves
    assert shared.used(0) == 470_000
    assert shared.roll(now + 1) == [0]  # midnight UTC
    assert shared.used(0) == 0 and shared.left(0) == 10**6
    worker.settle((0,), 70_000, 90_000)  # the request in flight: its cost beyond its reservation
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
