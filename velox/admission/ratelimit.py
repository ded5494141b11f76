"""Admission: one global request rate across every worker process, decided per micro-batch.

The state is the native TokenBucket, which lives in a shared mapping created by the supervisor
before it forks the workers, so all of them draw from ONE bucket. A worker asks once per batch
(`admit(n)` is one `acquire_up_to`) and admits the first k requests of the batch in arrival
order; the rest are refused with a Retry-After computed from the bucket's own refill schedule.

With VELOX_REDIS_URL (several hosts, velox.cluster.leases) the bucket is instead entry 0 of a native
`Limits` in LEASED mode: the host's Redis refresher fills it with tokens leased from the one
bucket all hosts share (or, while Redis is unreachable, turns it into a clock-refilled bucket
holding this host's share). The workers' path is the same: shared memory only, never Redis.
`Limits.take` is all-or-nothing, so a batch's prefix is taken as whole tokens available, with
a few bounded retries when other workers race for the same tokens.
"""

from __future__ import annotations

from typing import Any

from velox.state.limits import Limits, TokenBucket

# Retries of a batch's take when another worker took tokens between the level read and the take.
_TAKE_TRIES = 4


class Limiter:
    __slots__ = ("bucket", "limits", "index", "rate_per_minute", "burst")

    def __init__(self, bucket: TokenBucket | None, limits: Any = None, index: int = 0,
                 rate_per_minute: int = 0, burst: int = 0) -> None:
        self.bucket = bucket  # None: no limit, or the shared (Redis-leased) bucket below
        self.limits = limits  # velox.state.limits.Limits with VELOX_REDIS_URL, else None
        self.index = index
        self.rate_per_minute = rate_per_minute  # global, across every host sharing the limit
        self.burst = burst

    @classmethod
    def create(cls, rate_per_minute: int, burst: int, shared: bool = False) -> Limiter:
        """Create the bucket; must run in the supervisor, before the workers fork.

        shared=True (VELOX_REDIS_URL): a LEASED Limits entry, for velox.cluster.leases to fill.
        """
        if rate_per_minute <= 0:
            return cls(None)
        if shared:
            return cls(None, Limits(1), 0, rate_per_minute, burst)
        return cls(TokenBucket(rate_per_minute, burst), None, 0, rate_per_minute, burst)

    @property
    def enabled(self) -> bool:
        return self.bucket is not None or self.limits is not None

    def admit(self, n: int) -> int:
        """How many of the next n requests may go now (all or a prefix)."""
        bucket = self.bucket
        if bucket is not None:
            return bucket.acquire_up_to(n)
        limits = self.limits
        if limits is None:
            return n
        return take_up_to(limits, self.index, n)

    def retry_after_s(self) -> int:
        """Whole seconds until one more request can be admitted (at least 1)."""
        bucket = self.bucket
        if bucket is None:
            # Shared mode: a spent lease is replaced within a refresher tick (0.05 s), and
            # Redis is asked again within a second; below 60 rpm per host it is a hint.
            return 1
        wait_us = bucket.wait_hint_us(1)
        return max(1, -(-wait_us // 1_000_000))

    def available(self) -> int:
        if self.bucket is not None:
            return self.bucket.available()
        if self.limits is not None:
            return int(self.limits.level(self.index))
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
