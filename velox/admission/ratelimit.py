"""Admission: one global request rate across every worker process, decided per micro-batch.

The state is entry 0 of a native `Limits` (velox.state.limits: the one token bucket of the
native core, as the keys' and upstreams' limits are), which lives in a shared mapping created
by the supervisor before it forks the workers, so all of them draw from ONE bucket. A worker
asks once per batch (`take(n)`) and admits the first k requests of the batch in arrival
order; the rest are refused with a Retry-After computed from the bucket's rate.

Alone, the entry refills from the clock (rate per minute, at most burst held, starting full).
With VELOX_REDIS_URL (several hosts, velox.cluster.leases) the entry is LEASED instead: the
host's Redis refresher fills it with tokens leased from the one bucket all hosts share (or,
while Redis is unreachable, turns it into a clock-refilled bucket holding this host's share).
The workers' path is the same: shared memory only, never Redis. `Limits.take` is
all-or-nothing, so a batch's prefix is taken as whole tokens available, with a few bounded
retries when other workers race for the same tokens.
"""

from __future__ import annotations

from typing import Any

from velox.state.limits import Limits

# Retries of a batch's take when another worker took tokens between the level read and the take.
_TAKE_TRIES = 4
# The gateway's entry of its Limits.
GLOBAL = 0
_US_PER_MINUTE = 60_000_000


class Limiter:
    __slots__ = ("limits", "index", "rate_per_minute", "burst", "shared")

    def __init__(self, limits: Limits | None, rate_per_minute: int = 0, burst: int = 0,
                 shared: bool = False) -> None:
        self.limits = limits  # None: no limit
        self.index = GLOBAL
        self.rate_per_minute = rate_per_minute  # global, across every host sharing the limit
        self.burst = burst
        self.shared = shared  # leased from Redis (VELOX_REDIS_URL), else clock-refilled

    @classmethod
    def create(cls, rate_per_minute: int, burst: int, shared: bool = False) -> Limiter:
        """Create the bucket; must run in the supervisor, before the workers fork.

        shared=True (VELOX_REDIS_URL): a LEASED entry, for velox.cluster.leases to fill.
        """
        if rate_per_minute <= 0:
            return cls(None)
        limits = Limits(1)
        if not shared:
            limits.configure(GLOBAL, rate_per_minute, burst)
        return cls(limits, rate_per_minute, burst, shared)

    @property
    def enabled(self) -> bool:
        return self.limits is not None

    def take(self, n: int) -> int:
        """How many of the next n requests may go now (all or a prefix)."""
        limits = self.limits
        if limits is None:
            return n
        return take_up_to(limits, GLOBAL, n)

    def retry_after_s(self) -> int:
        """Whole seconds until one more request can be admitted (at least 1)."""
        limits = self.limits
        if limits is None or self.shared:
            # Shared mode: a spent lease is replaced within a refresher tick (0.05 s), and
            # Redis is asked again within a second; below 60 rpm per host it is a hint.
            return 1
        short = 1 - limits.level(GLOBAL)  # whole tokens missing for one request (debt too)
        if short <= 0:
            return 1
        wait_us = -(-short * _US_PER_MINUTE // self.rate_per_minute)
        return max(1, -(-wait_us // 1_000_000))

    def available(self) -> int:
        if self.limits is not None:
            return int(self.limits.level(GLOBAL))
        return -1


def take_up_to(limits: Any, index: int, n: int) -> int:
    """Take min(n, whole tokens there) from an all-or-nothing `Limits` bucket; how many."""
    want = n
    for _ in range(_TAKE_TRIES):
        if want <= 0:
            return 0
        if limits.take(index, want) == 0:
            return want
        want = min(want - 1, int(limits.level(index)))
    return 0
