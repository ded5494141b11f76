"""Field numbers of the shared-memory counters, and the tables that map answers onto them.

The native `Counters` and `Histogram` know only numbers; what each number means is fixed here,
once, for every writer (the workers' stages) and every reader (the supervisor, /stats,
/metrics). Nothing here imports anything but the standard library and `core.types`.
"""

from __future__ import annotations

from enum import IntEnum

from velox.core.types import Kind


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
    UPSTREAM_PING_TIMEOUTS = 31  # upstream connections replaced for not answering a PING
    UPSTREAM_WARMUP_TIMEOUTS = 32  # warm-ups that got no answer within the connect timeout
    UPSTREAM_TIMEOUT_RETIREMENTS = 33  # connections retired after request timeouts in a row
    # Response cache (velox.cache.front): each model call of a cached route counts once as a hit,
    # a miss (sent upstream), a bypass (no-store, uncacheable) or coalesced (answered by an
    # identical request's upstream call).
    CACHE_HITS = 34
    CACHE_MISSES = 35
    CACHE_BYPASSES = 36
    CACHE_COALESCED = 37
    CACHE_STORES = 38  # answers stored
    CACHE_ALONE = 39  # followers sent on their own because their leader failed
    # Embeddings batching (velox.batching.batch): upstream calls of batching routes ("batches", lone
    # requests count as batches of one), the client requests they carried, why merged ones
    # left, and members sent again on their own after a merged call's 400.
    EMB_BATCHES = 40
    EMB_BATCH_MEMBERS = 41
    EMB_TIMEOUT_BATCHES = 42  # left max_wait_ms after their first member arrived
    EMB_FULL_BATCHES = 43  # left when max_requests or max_inputs was reached
    EMB_SPLIT_RETRIES = 44  # members re-sent alone after their merged call got a 400
    EMB_IMMEDIATE_BATCHES = 45  # left at once: no call of their group was in flight
    # The response cache's Redis tier (velox.cache.redis, VELOX_REDIS_URL): requests answered
    # from Redis (also in CACHE_HITS), not found there, gone on without its answer (failed,
    # timed out, skipped while down); answers written to Redis, and not written.
    CACHE_REDIS_HITS = 46
    CACHE_REDIS_MISSES = 47
    CACHE_REDIS_ERRORS = 48
    CACHE_REDIS_STORES = 49
    CACHE_REDIS_DROPPED = 50
    WRITE_TIMEOUTS = 51  # client connections aborted for taking nothing for VELOX_WRITE_TIMEOUT_MS
    # Streaming followers of a live coalesced stream cut off for falling too far behind it.
    CACHE_FOLLOWERS_CUT = 52
    # Traces (VELOX_OTEL_ENDPOINT): spans the collector took, and spans lost (the export queue
    # was full, or the export failed: the collector unreachable, silent or refusing).
    TRACE_SPANS_EXPORTED = 53
    TRACE_SPANS_DROPPED = 54
    # Gauge: the run-time keys' version this worker has applied (velox.admission.runtime); -1
    # for only the set inherited at fork. /stats shows it per worker: who is behind.
    KEYS_VERSION = 55
    # Access-log lines dropped because stdout blocked past VELOX_ACCESS_LOG_BUFFER_BYTES, or
    # was closed (velox.admin.accesslog).
    ACCESS_LOG_DROPPED = 56
    # Runs of the worker's timers of periodic work (its tick, the access log's and the
    # ledger's flushes, the upstream pools' sweeps): what wakes an idle worker (/stats).
    TIMER_WAKES = 57


class H(IntEnum):
    TOTAL = 0  # request received to response complete (non-streaming) or first byte (streaming)
    UPSTREAM = 1  # request sent upstream to response headers received
    OVERHEAD = 2  # TOTAL minus UPSTREAM: what the gateway itself added
    CACHE_HIT = 3  # request received to a cache hit's answer written (not in TOTAL)


# The status classes every counter of answers uses, and THE table from a status to its class:
# STATUS_CLASS[status // 100] is the index into STATUS_CLASSES. 1xx is never a final answer and
# counts with 2xx; a status below 100 or past 599 is no valid answer and counts with 5xx.
STATUS_CLASSES = ("2xx", "3xx", "4xx", "5xx")
STATUS_CLASS = (3, 0, 0, 1, 2, 3, 3, 3, 3, 3)
# Responses by request kind and status class live in their own Counters: field = kind * 4 + class.
# Label of each kind in /metrics and /stats (named `route` there, as it always was). Requests
# refused before routing (404, 405, bad HTTP) are counted as FORWARD: ingress gives them that kind.
KIND_NAMES = {Kind.MODEL_CALL: "model_call", Kind.MODEL_OTHER: "model_other",
              Kind.FORWARD: "forward", Kind.ROOT: "root",
              Kind.HEALTH: "healthz", Kind.READY: "readyz"}
KIND_FIELDS = (max(Kind) + 1) * len(STATUS_CLASSES)
# KIND_STATUS_FIELD[kind][status // 100]: one tuple index on the hot path, no arithmetic.
KIND_STATUS_FIELD = tuple(
    tuple(kind * len(STATUS_CLASSES) + c for c in STATUS_CLASS) for kind in range(max(Kind) + 1)
)
# RESPONSE_FIELD[status // 100]: the F field counting an answer of that class, as a plain int
# (an IntEnum member costs a class attribute lookup and a conversion in every Counters.add,
# ~0.4 us a call against ~0.1: benches/bench_books.py).
RESPONSE_FIELD = tuple(int(F.RESP_2XX) + c for c in STATUS_CLASS)


# Fields per Counters block of the token counts (the native Counters' most fields a row; a
# power of two, so a field's block and column are a shift and a mask: velox.relay.usage.Ledger).
TOKEN_BLOCK = 4096
# /metrics' key label for the keys past VELOX_METRICS_KEYS, summed (a key's name cannot start
# with '_', velox.config.tables).
OTHER_KEYS = "_other"

# Why an attempt was sent again (velox_retries_total{reason}); field numbers of `retries`.
RETRY_REASONS = ("connect", "timeout", "status_5xx", "status_429", "refused", "protocol")
# Attempts by upstream and outcome class (velox_upstream_requests_total{upstream,status_class}):
# field = upstream index * len(UPSTREAM_CLASSES) + class; "error" is an attempt without an
# answer (connection error, timeout, reset).
# class = STATUS_CLASS[status // 100], or UPSTREAM_ERROR.
UPSTREAM_CLASSES = (*STATUS_CLASSES, "error")
UPSTREAM_ERROR = 4


class KF(IntEnum):
    """Per-key counters (one native Counters per field, field = the key's place in its
    segment of the key table): refusals by reason, then the tokens its answers used (every
    keyed request's, file or run-time key, whatever the route). Admitted requests are counted
    natively, by the gauge (Limits.entered)."""

    REFUSED_RPM = 0
    REFUSED_TPM = 1
    REFUSED_PARALLEL = 2
    REFUSED_MODEL = 3
    REFUSED_FORWARD = 4
    TOKENS_IN = 5
    TOKENS_OUT = 6


REFUSAL_REASONS = ("rpm", "tpm", "max_parallel", "model", "forward")  # KF.REFUSED_* in order
