"""velox_lab._bucket (native/lab_bucket.c): the lone shared token bucket (native/vx_bucket.h),
for the benchmarks that measure it and its tests; the gateway's limits are velox._native.Limits."""

from typing import final

@final
class TokenBucket:
    """Lock-free integer token bucket in an anonymous shared mapping.

    Starts full. A bucket created before fork() is one bucket for the parent and every
    child. Refill is lazy (credited when a take comes up short), integer-only, with
    microsecond precision.
    """

    def __init__(self, rate_per_minute: int, burst: int) -> None:
        """Both in [1, 10**9]; otherwise ValueError naming the argument."""
    def acquire(self, n: int = 1, /) -> bool:
        """Take n tokens at once or none. n > burst: False at once. n < 1: ValueError."""
    def acquire_up_to(self, n: int, /) -> int:
        """Take min(n, whole tokens available); return how many (0 for n == 0).

        n < 0: ValueError. Huge n is clamped to burst."""
    def wait_hint_us(self, n: int = 1, /) -> int:
        """Microseconds until n tokens can be available: 0 if now, -1 if n > burst."""
    def available(self) -> int:
        """Whole tokens available now, pending refill included (approximate; for metrics)."""
    @property
    def rate_per_minute(self) -> int: ...
    @property
    def burst(self) -> int: ...
    # Test hooks, not API: explicit clocks and a GIL-free hammer for exactness tests.
    def _acquire_at(self, n: int, now_us: int, /) -> bool:
        """Test hook: acquire(n) with an explicit CLOCK_MONOTONIC time in microseconds."""
    def _acquire_up_to_at(self, n: int, now_us: int, /) -> int:
        """Test hook: acquire_up_to(n) with an explicit clock."""
    def _hammer(self, duration_us: int, n: int, /) -> int:
        """Test hook: with the GIL released, call acquire(n) in a tight loop for duration_us
        (at most 60 s); return the number of tokens admitted."""
