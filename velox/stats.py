"""Shared counters and latency histograms: what the workers write and anyone can read.

One `SharedStats` is created by the supervisor before it forks, so every worker writes its own
slot (its own cache lines) of the same shared mapping, and the supervisor or any reader sums
the slots without asking the workers anything. Field meanings are fixed here; the native
`Counters` and `Histogram` know only numbers.

Imports: the native extension, _types (route numbers), health and tables (the upstreams' shared
state), keys (the gateway keys' shared limits) and stdlib.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from velox._native import Counters, Histogram
from velox._types import Route
from velox.health import SharedHealth
from velox.keys import SharedKeys
from velox.tables import DEFAULT_UPSTREAM, Tables, UpstreamSpec, single_upstream


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
    # Response cache (velox.cache): each model call of a cached route counts once as a hit,
    # a miss (sent upstream), a bypass (no-store, uncacheable) or coalesced (answered by an
    # identical request's upstream call).
    CACHE_HITS = 34
    CACHE_MISSES = 35
    CACHE_BYPASSES = 36
    CACHE_COALESCED = 37
    CACHE_STORES = 38  # answers stored
    CACHE_ALONE = 39  # followers sent on their own because their leader failed
    # Embeddings batching (velox.batch): upstream calls of batching routes ("batches", lone
    # requests count as batches of one), the client requests they carried, why merged ones
    # left, and members sent again on their own after a merged call's 400.
    EMB_BATCHES = 40
    EMB_BATCH_MEMBERS = 41
    EMB_TIMEOUT_BATCHES = 42  # left max_wait_ms after their first member arrived
    EMB_FULL_BATCHES = 43  # left when max_requests or max_inputs was reached
    EMB_SPLIT_RETRIES = 44  # members re-sent alone after their merged call got a 400
    EMB_IMMEDIATE_BATCHES = 45  # left at once: no call of their group was in flight
    # The response cache's Redis tier (velox.cache_redis, VELOX_REDIS_URL): requests answered
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


class H(IntEnum):
    TOTAL = 0  # request received to response complete (non-streaming) or first byte (streaming)
    UPSTREAM = 1  # request sent upstream to response headers received
    OVERHEAD = 2  # TOTAL minus UPSTREAM: what the gateway itself added
    CACHE_HIT = 3  # request received to a cache hit's answer written (not in TOTAL)


# Responses by route and status class live in their own Counters: field = route * 4 + class.
STATUS_CLASSES = ("2xx", "3xx", "4xx", "5xx")
# Label of each route in /metrics and /stats. Requests refused before routing (404, 405, bad
# HTTP) are counted as FORWARD, since ingress gives them that route.
ROUTE_NAMES = {Route.MODEL_CALL: "model_call", Route.MODEL_OTHER: "model_other",
               Route.FORWARD: "forward", Route.ROOT: "root",
               Route.HEALTH: "healthz", Route.READY: "readyz"}
ROUTE_FIELDS = (max(Route) + 1) * len(STATUS_CLASSES)
# ROUTE_STATUS_FIELD[route][status // 100]: one tuple index on the hot path, no arithmetic.
# 1xx is never a final answer and counts with 2xx, as in F; anything past 5xx counts as 5xx.
_CLASS_OF = (0, 0, 0, 1, 2, 3, 3, 3, 3, 3)
ROUTE_STATUS_FIELD = tuple(
    tuple(route * len(STATUS_CLASSES) + c for c in _CLASS_OF) for route in range(max(Route) + 1)
)


# Fields per Counters block of the token counts (the native Counters' most fields a row; a
# power of two, so a field's block and column are a shift and a mask: velox.usage.Ledger).
TOKEN_BLOCK = 4096
# /metrics' key label for the keys past VELOX_METRICS_KEYS, summed (a key's name cannot start
# with '_', velox.tables).
OTHER_KEYS = "_other"

# Why an attempt was sent again (velox_retries_total{reason}); field numbers of `retries`.
RETRY_REASONS = ("connect", "timeout", "status_5xx", "status_429", "refused", "protocol")
# Attempts by upstream and outcome class (velox_upstream_requests_total{upstream,status_class}):
# field = upstream index * len(UPSTREAM_CLASSES) + class; "error" is an attempt without an
# answer (connection error, timeout, reset).
UPSTREAM_CLASSES = ("2xx", "3xx", "4xx", "5xx", "error")
UPSTREAM_CLASS_OF = (0, 0, 0, 1, 2, 3, 3, 3, 3, 3)  # by status // 100
UPSTREAM_ERROR = 4


class SharedStats:
    """Everything the workers write and the admin reads, mapped before the workers fork.

    Beside the per-worker counters and latency histograms: the upstreams' shared live state
    (`health`: breakers, in-flight gauges, the retry budget), one upstream-latency histogram
    per upstream, the picks of every route target (`targets`, field = the target's position in
    `target_names`) and retries by reason.

    Worker slots: there are 2 x `workers` of them (`slots`), so that during a reload the old
    and the new worker of logical slot i run side by side in slots i and i + workers without
    sharing a gauge. `active` (one shared row, field = slot) says which slots make up the
    serving set: readiness, the hang watch and the per-worker gauges of /stats and /metrics
    look only at those. Counters and histograms sum over every slot, so they stay cumulative
    across reloads. `with_tables()` makes the shared state of a new configuration.
    """

    __slots__ = ("workers", "slots", "active", "counters", "histograms", "routes", "tables",
                 "health", "upstream_latency", "targets", "target_names", "retries",
                 "upstream_status", "cache", "keys", "tokens", "key_names", "route_models")

    def __init__(self, workers: int, tables: Tables | None = None) -> None:
        self.workers = workers
        self.slots = slots = 2 * workers
        self.active = Counters(1, slots)
        for slot in range(workers):
            self.active.set(0, slot, 1)
        self.counters = Counters(slots, len(F))
        self.histograms = tuple(Histogram(slots) for _ in H)
        self.routes = Counters(slots, ROUTE_FIELDS)
        self.retries = Counters(slots, len(RETRY_REASONS))
        # The response cache's shared store (velox.cache.create_store), set by the supervisor
        # before it forks when caching is on anywhere; None otherwise.
        self.cache: Any = None
        self._per_upstream(tables)

    def _per_upstream(self, tables: Tables | None, keys: SharedKeys | None = None) -> None:
        if tables is None:
            tables = single_upstream(UpstreamSpec(DEFAULT_UPSTREAM, "https://api.openai.com"))
        slots = self.slots
        self.tables = tables
        self.health = SharedHealth.create(tables)
        self.upstream_latency = tuple(Histogram(slots) for _ in tables.upstreams)
        self.target_names = tuple((route.model, target.upstream)
                                  for route in tables.routes for target in route.targets)
        self.targets = Counters(slots, max(1, len(self.target_names)))
        self.upstream_status = Counters(slots, len(tables.upstreams) * len(UPSTREAM_CLASSES))
        # The [[key]] limits: kept across a reload that keeps the same key names (velox.keys).
        self.keys = SharedKeys(tables.keys, slots, keys)
        # Tokens by gateway key and route (velox.usage.Ledger writes them): field =
        # ((key + 1) x routes + route) x 2 + kind (0 input, 1 output); key -1 is "no key".
        self.key_names = ("-",) + tuple(k.name for k in tables.keys)
        self.route_models = tuple(r.model for r in tables.routes)
        # Counters hold at most TOKEN_BLOCK fields a row: field f is tokens[f // TOKEN_BLOCK].
        size = max(1, len(self.key_names) * len(self.route_models) * 2)
        self.tokens = tuple(Counters(slots, min(TOKEN_BLOCK, size - start))
                            for start in range(0, size, TOKEN_BLOCK))

    def with_tables(self, tables: Tables) -> SharedStats:
        """The shared state for a reloaded configuration; call it before forking its workers.

        Shares this one's slot mask, worker counters, histograms, routes and retries (they are
        cumulative and indexed by nothing the tables decide); makes new per-upstream parts
        (health, upstream latency and status, target picks), which are indexed by the
        upstreams' and targets' positions in the new tables, so they start from zero.
        """
        new = object.__new__(SharedStats)
        for name in ("workers", "slots", "active", "counters", "histograms", "routes",
                     "retries", "cache"):
            setattr(new, name, getattr(self, name))
        new._per_upstream(tables, self.keys)
        return new

    def forget_slot(self, slot: int) -> None:
        """The worker of `slot` died (SIGKILL, crash): give back the shared places it held."""
        self.keys.forget_slot(slot)

    def is_active(self, slot: int) -> bool:
        return bool(self.active.get(0, slot))

    def active_slots(self) -> list[int]:
        row = self.active.snapshot()[0]
        return [slot for slot in range(self.slots) if row[slot]]

    def all_ready(self) -> bool:
        counters = self.counters
        return all(counters.get(slot, F.READY) for slot in self.active_slots())

    def token_rows(self, own_keys: int | None = None) -> list[tuple[str, str, int, int]]:
        """(key, route, input, output) for every key and route that used tokens. With
        `own_keys`, keys past the first `own_keys` (file order) are summed per route under
        OTHER_KEYS (the no-key row '-' is always its own)."""
        totals = [n for block in self.tokens for n in block.totals()]
        width = len(self.route_models)
        names = self.key_names if own_keys is None else self.key_names[:own_keys + 1]
        rows = []
        for k, key in enumerate(names):
            for r, route in enumerate(self.route_models):
                field = (k * width + r) * 2
                if totals[field] or totals[field + 1]:
                    rows.append((key, route, totals[field], totals[field + 1]))
        if len(names) < len(self.key_names):
            start = len(names) * width * 2
            for r, route in enumerate(self.route_models):
                inp = sum(totals[start + r * 2::width * 2])
                out = sum(totals[start + r * 2 + 1::width * 2])
                if inp or out:
                    rows.append((OTHER_KEYS, route, inp, out))
        return rows

    def totals(self) -> dict[str, int]:
        totals = self.counters.totals()
        return {f.name.lower(): totals[f] for f in F}
