"""A worker's admission to and settlement of spend budgets, one call each end.

`BudgetGate` (native, bind_budgets.c) is what the request path uses: a request of a budgeted
key is admitted with `gate.admit(budgets, estimate)` (refused while any budget has nothing
left, else its estimate taken from each, into debt when less is left, and counted in the
worker slot's in-flight row) and settled with `gate.settle(budgets, estimate, cost)`. Before
it, the same was ~10 Python-level calls a request (levels, takes, in-flight counts, the
remaining-budget header's formatting: ~4 us of the ~10 a budget added, bench_spend.py).

`GateTwin` is its reference twin in Python, the same arithmetic over the same shared state:
the unit tests run both side by side, and the budgets leased across hosts (velox.spend.hosts),
whose admission also asks what Redis said, go on using its steps.
"""

from __future__ import annotations

from velox.state.limits import BudgetGate, Limits
from velox.state.stats import Counters

__all__ = ["NANOS_PER_USD", "BudgetGate", "GateTwin", "usd_text"]

NANOS_PER_USD = 10**9


# Texts of costs already seen: answers of one model and similar size cost the same, and a
# lookup is ~0.05 us where formatting is ~0.4. Emptied when full (a bound, not an LRU).
_TEXTS: dict[int, bytes] = {}
_TEXTS_MAX = 4096


def usd_text(nanos: int) -> bytes:
    """Nano-USD as a decimal of USD with 9 places at most, trailing zeros cut."""
    text = _TEXTS.get(nanos)
    if text is None:
        whole, frac = divmod(nanos, NANOS_PER_USD)
        text = b"%d" % whole if not frac else (b"%d.%09d" % (whole, frac)).rstrip(b"0")
        if len(_TEXTS) >= _TEXTS_MAX:
            _TEXTS.clear()
        _TEXTS[nanos] = text
    return text


class GateTwin:
    """BudgetGate in Python (see the module docstring)."""

    __slots__ = ("limits", "in_flight", "units", "slot", "carry")

    def __init__(self, limits: Limits, in_flight: Counters, units: tuple[int, ...],
                 slot: int) -> None:
        self.limits = limits
        self.in_flight = in_flight
        self.units = units
        self.slot = slot
        self.carry = [0] * len(units)

    def admit(self, budgets: tuple[int, ...], estimate: int) -> bytes | int:
        level, units = self.limits.level, self.units
        lowest = -1
        for b in budgets:
            here = level(b)
            if here <= 0:
                return b
            here *= units[b]
            if lowest < 0 or here < lowest:
                lowest = here
        if estimate > 0:
            for b in budgets:
                self.reserve(b, -(-estimate // units[b]))
        return usd_text(max(0, lowest))

    def reserve(self, b: int, n: int) -> None:
        """Take `n` units of budget `b` for a request just admitted, into debt when less is
        left (the take, refused, still tells the bucket's demand)."""
        limits = self.limits
        if limits.take(b, n) != 0:
            limits.charge(b, n)
        self.in_flight.add(self.slot, b, n)

    def settle(self, budgets: tuple[int, ...], estimate: int, cost: int) -> None:
        limits, units, carry, slot = self.limits, self.units, self.carry, self.slot
        for b in budgets:
            reserved = -(-estimate // units[b]) if estimate > 0 else 0
            used, carry[b] = divmod(cost + carry[b], units[b])
            if used > reserved:
                limits.charge(b, used - reserved)
            elif used < reserved:
                limits.refund(b, reserved - used)
            if reserved:
                self.in_flight.add(slot, b, -reserved)
