"""Shared counters and latency histograms: what the workers write and anyone can read.

One `SharedStats` is created by the supervisor before it forks, so every worker writes its own
slot (its own cache lines) of the same shared mapping, and the supervisor or any reader sums
the slots without asking the workers anything. Field meanings are fixed here; the native
`Counters` and `Histogram` know only numbers.

Imports: the native extension, _types (route numbers) and stdlib.
"""

from __future__ import annotations

from enum import IntEnum

from velox._native import Counters, Histogram
from velox._types import Route


class F(IntEnum):
    """Counter fields of one worker slot. Gauges are marked; everything else only grows."""

    REQUESTS = 0  # requests answered (any status)
    RESP_2XX = 1
    RESP_3XX = 2
    RESP_4XX = 3
    RESP_5XX = 4
    REJECT_RING_FULL = 5  # 503 overloaded
    REJECT_RATE_LIMITED = 6  # 429 from the gateway's own bucket
    BYTES_IN = 7  # request bodies
    BYTES_OUT = 8  # whole responses written to clients
    BATCHES = 9
    BATCH_ITEMS = 10
    BATCHES_FULL = 11  # batches that hit VELOX_BATCH_MAX
    UPSTREAM_REQUESTS = 12
    UPSTREAM_ERRORS = 13  # 502/504 produced by the gateway
    STREAMS_CANCELLED = 14  # upstream streams reset because the client left
    RECONNECTS = 15
    GOAWAYS = 16
    RETRIES = 17  # requests re-sent on another connection (not yet processed upstream)
    IN_FLIGHT = 18  # gauge: requests inside the worker
    RING_DEPTH = 19  # gauge, sampled each batch
    READY = 20  # gauge: 1 once the worker's upstream pool is warm
    PID = 21  # gauge
    CORE = 22  # gauge: core the worker is pinned to, -1 if not pinned
    NUMA_NODE = 23  # gauge
    UPSTREAM_CONNECTIONS = 24  # gauge: open upstream connections
    STARTS = 25  # times a worker started in this slot (restarts = STARTS - 1)
    ACCESS_LOG_LINES = 26  # access-log lines written (requests minus these: lines dropped)
    HEARTBEAT_MS = 27  # gauge: the worker loop's last tick, time.monotonic() in ms (0: none yet)
    HANG_KILLS = 28  # workers in this slot killed by the supervisor for a silent loop
    RECEIVE_TIMEOUTS = 29  # requests cut off with 408 by VELOX_BODY_TIMEOUT_MS
    FD_EXHAUSTED = 30  # times the worker ran out of file descriptors (new clients were reset)


class H(IntEnum):
    TOTAL = 0  # request received to response complete (non-streaming) or first byte (streaming)
    UPSTREAM = 1  # request sent upstream to response headers received
    OVERHEAD = 2  # TOTAL minus UPSTREAM: what the gateway itself added


# Responses by route and status class live in their own Counters: field = route * 4 + class.
STATUS_CLASSES = ("2xx", "3xx", "4xx", "5xx")
# Label of each route in /metrics and /stats. Requests refused before routing (404, 405, bad
# HTTP) are counted as FORWARD, since ingress gives them that route.
ROUTE_NAMES = {Route.MODEL_CALL: "model_call", Route.FORWARD: "forward", Route.ROOT: "root",
               Route.HEALTH: "healthz", Route.READY: "readyz"}
ROUTE_FIELDS = (max(Route) + 1) * len(STATUS_CLASSES)
# ROUTE_STATUS_FIELD[route][status // 100]: one tuple index on the hot path, no arithmetic.
# 1xx is never a final answer and counts with 2xx, as in F; anything past 5xx counts as 5xx.
_CLASS_OF = (0, 0, 0, 1, 2, 3, 3, 3, 3, 3)
ROUTE_STATUS_FIELD = tuple(
    tuple(route * len(STATUS_CLASSES) + c for c in _CLASS_OF) for route in range(max(Route) + 1)
)


class SharedStats:
    __slots__ = ("workers", "counters", "histograms", "routes")

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.counters = Counters(workers, len(F))
        self.histograms = tuple(Histogram(workers) for _ in H)
        self.routes = Counters(workers, ROUTE_FIELDS)

    def all_ready(self) -> bool:
        rows = self.counters.snapshot()
        return all(row[F.READY] for row in rows)

    def totals(self) -> dict[str, int]:
        totals = self.counters.totals()
        return {f.name.lower(): totals[f] for f in F}
