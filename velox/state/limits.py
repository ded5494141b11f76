"""The face of the native limits core (native/vx_limits.c): shared token buckets and
concurrency gauges made before fork (or on a memfd, see velox.state.keys.KeyTable), one state
for every worker.

`Limits` is n buckets and n gauges in one shared mapping: the keys' rpm/tpm/max_parallel,
the upstreams' rpm, and the gateway's global rate (entry 0 of its own, clock-refilled or
leased from Redis: velox.admission.ratelimit). `Admit` names what refused a `Limits.admit`,
and `refusal`/`remaining` decode its packed result by name. `BudgetGate` drives a Limits and
a Counters together for spend budgets (velox.spend.gate). Only velox.state imports the
extension for them (the import contract in pyproject.toml).
"""

from __future__ import annotations

import enum

from velox._native import (
    ADMIT_LEFT_SHIFT,
    ADMIT_PARALLEL,
    ADMIT_REASON_BITS,
    ADMIT_REQUESTS,
    ADMIT_TOKENS,
    LIMITS_LEASE_WAIT_US,
    LIMITS_NEVER,
    BudgetGate,
    Limits,
)

__all__ = ["LIMITS_LEASE_WAIT_US", "LIMITS_NEVER", "Admit", "BudgetGate", "Limits", "refusal",
           "remaining"]


class Admit(enum.IntEnum):
    """What refused a `Limits.admit` (its result when not admitted), by name."""

    REQUESTS = ADMIT_REQUESTS
    TOKENS = ADMIT_TOKENS
    PARALLEL = ADMIT_PARALLEL


_REASON_MASK = (1 << ADMIT_REASON_BITS) - 1
_LEFT_MASK = (1 << ADMIT_LEFT_SHIFT) - 1
_ADMIT = {a.value: a for a in Admit}


def refusal(result: int) -> tuple[Admit, int]:
    """A refused `Limits.admit` result (>= 0): what refused, and the wait in microseconds
    (0: never, the bucket cannot hold that many)."""
    return _ADMIT[result & _REASON_MASK], result >> ADMIT_REASON_BITS


def remaining(result: int) -> tuple[int, int]:
    """An admitted `Limits.admit` result (< 0): the whole tokens left in its request bucket
    and in its token bucket (0 for a skipped step), for the x-ratelimit-remaining-* headers."""
    left = ~result
    return left & _LEFT_MASK, left >> ADMIT_LEFT_SHIFT
