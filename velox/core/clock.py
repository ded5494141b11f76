"""The one clock of shared state: CLOCK_MONOTONIC in integer milliseconds.

Everything written to shared memory or compared across processes in milliseconds uses
`now_ms()`: breakers and rpm buckets (the native core keeps their times in ms), the cache
store's ages and leases, the workers' heartbeats the supervisor and the admin read. On Linux
`time.monotonic` is CLOCK_MONOTONIC, the clock the native core reads, so seconds from
`time.monotonic()` (timers, deadlines) and these milliseconds never disagree.

Latencies are measured apart from it, in `time.perf_counter_ns()` stamps on each request.
"""

from __future__ import annotations

from time import monotonic_ns


def now_ms() -> int:
    """CLOCK_MONOTONIC in milliseconds."""
    return monotonic_ns() // 1_000_000
