"""Admission: one global request rate across every worker process, decided per micro-batch.

The state is the native TokenBucket, which lives in a shared mapping created by the supervisor
before it forks the workers, so all of them draw from ONE bucket. A worker asks once per batch
(`admit(n)` is one `acquire_up_to`) and admits the first k requests of the batch in arrival
order; the rest are refused with a Retry-After computed from the bucket's own refill schedule.

Imports: the native extension and stdlib.
"""

from __future__ import annotations

from velox._native import TokenBucket


class Limiter:
    __slots__ = ("bucket",)

    def __init__(self, bucket: TokenBucket | None) -> None:
        self.bucket = bucket  # None: VELOX_RATE_LIMIT_RPM=0, no limit

    @classmethod
    def create(cls, rate_per_minute: int, burst: int) -> Limiter:
        """Create the shared bucket; must run in the supervisor, before the workers fork."""
        return cls(TokenBucket(rate_per_minute, burst) if rate_per_minute > 0 else None)

    def admit(self, n: int) -> int:
        """How many of the next n requests may go now (all or a prefix)."""
        bucket = self.bucket
        return n if bucket is None else bucket.acquire_up_to(n)

    def retry_after_s(self) -> int:
        """Whole seconds until one more request can be admitted (at least 1)."""
        bucket = self.bucket
        if bucket is None:
            return 1
        wait_us = bucket.wait_hint_us(1)
        return max(1, -(-wait_us // 1_000_000))

    def available(self) -> int:
        return -1 if self.bucket is None else self.bucket.available()
