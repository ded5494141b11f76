"""`GET /metrics`: the Prometheus exposition, built by a prometheus-client collector.

`VeloxCollector` is registered on a private `CollectorRegistry` (so nothing of the process's
default registry leaks in) and reads, at scrape time, only what lives in shared memory: the
workers' counter slots, the native histograms and the token bucket. A scrape never talks to a
worker, so it costs the workers nothing and answers even when all of them are saturated.

Latency histograms: the native histogram has ~1,500 log-linear buckets; Prometheus wants a
small fixed set of cumulative `le` bounds that stay the same across scrapes, so the native
buckets are summed into `LE_BOUNDS_S`. A native bucket is counted under the first bound that
holds its whole range (at most 1/64 of the value wide), so a `le` count can lag by at most
the one native bucket straddling the bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from velox import __version__
from velox.config.settings import DEFAULT_METRICS_KEYS
from velox.core.clock import now_ms
from velox.core.fields import (
    KIND_NAMES,
    KIND_STATUS_FIELD,
    OTHER_KEYS,
    RETRY_REASONS,
    STATUS_CLASSES,
    UPSTREAM_CLASSES,
    F,
    H,
)
from velox.spend.gate import NANOS_PER_USD
from velox.state.stats import SharedStats

BREAKER_STATES = ("closed", "open", "half_open")
_TARGET_LABELS = ("route", "upstream", "model")

LE_BOUNDS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
               0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_HISTOGRAMS = (
    (H.TOTAL, "velox_request_duration_seconds",
     "Request's last byte to response complete (streams: to first byte), upstream included."),
    (H.UPSTREAM, "velox_upstream_latency_seconds",
     "Request sent upstream to the upstream's response headers."),
    (H.OVERHEAD, "velox_gateway_overhead_seconds",
     "What the gateway itself added: request duration minus upstream latency."),
    (H.CACHE_HIT, "velox_cache_hit_duration_seconds",
     "Request's last byte to a cache hit's answer written (hits are not in request_duration)."),
)
# (field, metric name, help) for per-worker counters read straight from F.
_COUNTERS = (
    (F.BYTES_IN, "velox_request_body_bytes", "Request body bytes received."),
    (F.BYTES_OUT, "velox_response_bytes", "Response bytes written to clients."),
    (F.BATCHES, "velox_batches", "Micro-batches drained from the ring."),
    (F.BATCH_ITEMS, "velox_batch_items", "Requests in those micro-batches."),
    (F.BATCHES_FULL, "velox_batches_full", "Micro-batches that hit VELOX_BATCH_MAX."),
    (F.UPSTREAM_REQUESTS, "velox_upstream_responses", "Upstream exchanges that got headers."),
    (F.UPSTREAM_ERRORS, "velox_upstream_errors",
     "Upstream exchanges the gateway failed with 5xx (no upstream response)."),
    (F.GOAWAYS, "velox_upstream_goaways", "GOAWAY frames received from the upstream."),
    (F.RECONNECTS, "velox_upstream_reconnects", "Upstream connections replaced."),
    (F.RETRIES, "velox_upstream_retries",
     "Requests re-sent on another connection (provably not processed upstream)."),
    (F.STREAMS_CANCELLED, "velox_upstream_streams_cancelled",
     "Upstream streams reset because the client left."),
    (F.ACCESS_LOG_LINES, "velox_access_log_lines", "Access-log lines written."),
    (F.ACCESS_LOG_DROPPED, "velox_access_log_dropped_lines",
     "Access-log lines dropped: stdout blocked past VELOX_ACCESS_LOG_BUFFER_BYTES, or closed."),
    (F.HANG_KILLS, "velox_worker_hang_kills",
     "Workers in this slot killed and restarted because their loop fell silent."),
    (F.RECEIVE_TIMEOUTS, "velox_request_receive_timeouts",
     "Requests cut off with 408 for not arriving within VELOX_BODY_TIMEOUT_MS."),
    (F.WRITE_TIMEOUTS, "velox_response_write_timeouts",
     "Client connections aborted for taking none of their answer for VELOX_WRITE_TIMEOUT_MS."),
    (F.FD_EXHAUSTED, "velox_fd_exhausted",
     "Times a worker ran out of file descriptors; new clients are reset meanwhile."),
    (F.UPSTREAM_PING_TIMEOUTS, "velox_upstream_ping_timeouts",
     "Upstream connections replaced because a PING went unanswered (silent upstream)."),
    (F.UPSTREAM_WARMUP_TIMEOUTS, "velox_upstream_warmup_timeouts",
     "Upstream warm-up requests unanswered within the connect timeout."),
    (F.UPSTREAM_TIMEOUT_RETIREMENTS, "velox_upstream_timeout_retirements",
     "Upstream connections retired after consecutive request timeouts."),
    (F.TRACE_SPANS_EXPORTED, "velox_trace_spans_exported",
     "Trace spans the OpenTelemetry collector accepted."),
    (F.TRACE_SPANS_DROPPED, "velox_trace_spans_dropped",
     "Trace spans lost: the export queue was full, or the collector could not be reached, did "
     "not answer or refused them."),
)
_CACHE_COUNTERS = (
    (F.CACHE_HITS, "velox_cache_hits", "Requests answered from the response cache."),
    (F.CACHE_MISSES, "velox_cache_misses", "Cacheable requests sent upstream."),
    (F.CACHE_BYPASSES, "velox_cache_bypasses",
     "Requests of cached routes that skipped the cache (no-store, uncacheable)."),
    (F.CACHE_COALESCED, "velox_cache_coalesced",
     "Requests answered by an identical request's upstream call (coalesced in flight)."),
    (F.CACHE_STORES, "velox_cache_stores", "Answers stored in the response cache."),
    (F.CACHE_ALONE, "velox_cache_sent_alone",
     "Coalesced requests sent on their own because the call they waited for failed."),
    (F.CACHE_FOLLOWERS_CUT, "velox_cache_followers_cut",
     "Streaming followers disconnected for falling too far behind the live stream they shared."),
    (F.CACHE_REDIS_HITS, "velox_cache_redis_hits",
     "Requests answered from the cache's Redis tier (also counted in velox_cache_hits)."),
    (F.CACHE_REDIS_MISSES, "velox_cache_redis_misses",
     "Local cache misses the Redis tier had no usable answer for."),
    (F.CACHE_REDIS_ERRORS, "velox_cache_redis_errors",
     "Local cache misses that went on without the Redis tier's answer (failed, timed out, "
     "or Redis down)."),
    (F.CACHE_REDIS_STORES, "velox_cache_redis_stores", "Answers written to the Redis tier."),
    (F.CACHE_REDIS_DROPPED, "velox_cache_redis_dropped",
     "Answers not written to the Redis tier (Redis down, write failed, too many waiting)."),
)
_GAUGES = (
    (F.IN_FLIGHT, "velox_in_flight_requests", "Requests inside the worker (sampled every 0.25 s)."),
    (F.RING_DEPTH, "velox_ring_depth", "Requests queued in the worker's ring (sampled)."),
    (F.UPSTREAM_CONNECTIONS, "velox_upstream_connections", "Open upstream connections."),
    (F.READY, "velox_worker_ready", "1 once the worker's upstream pool is warm."),
    (F.CORE, "velox_worker_core", "Core the worker is pinned to (-1: not pinned)."),
    (F.NUMA_NODE, "velox_worker_numa_node", "NUMA node of that core."),
)


class VeloxCollector(Collector):
    def __init__(self, shared: SharedStats, limiter: Any, ring_capacity: int,
                 started_at: float, profile_runs: Callable[[], tuple[int, bool]],
                 admin_refused: Callable[[], int] | None = None,
                 max_keys: int = DEFAULT_METRICS_KEYS) -> None:
        self.shared = shared
        # Gateway keys with their own series (VELOX_METRICS_KEYS); the rest are summed.
        self.max_keys = max_keys
        self.limiter = limiter
        self.ring_capacity = ring_capacity
        self.started_at = started_at  # time.time() when the supervisor started
        self.profile_runs = profile_runs
        self.admin_refused = admin_refused
        self.cluster: Any = None  # velox.cluster.leases.Cluster with VELOX_REDIS_URL

    def _upstreams(self) -> Iterator[Metric]:
        """Per upstream: attempts by outcome class, breaker state, in flight; retries by reason."""
        shared = self.shared
        live = shared.health.snapshot()["upstreams"]
        status = shared.upstream_status.totals()
        width = len(UPSTREAM_CLASSES)
        requests = CounterMetricFamily(
            "velox_upstream_requests", "Attempts sent to each upstream, by how they ended.",
            labels=["upstream", "status_class"])
        state = GaugeMetricFamily(
            "velox_upstream_state", "Circuit breaker state of each upstream (1: current).",
            labels=["upstream", "state"])
        in_flight = GaugeMetricFamily(
            "velox_upstream_in_flight", "Requests in flight on each upstream, all workers.",
            labels=["upstream"])
        for u, spec in enumerate(shared.tables.upstreams):
            for c, name in enumerate(UPSTREAM_CLASSES):
                requests.add_metric([spec.name, name], status[u * width + c])
            row = live[spec.name]
            for name in BREAKER_STATES:
                state.add_metric([spec.name, name], 1.0 if row["state"] == name else 0.0)
            in_flight.add_metric([spec.name], row["in_flight"])
        yield requests
        yield state
        yield in_flight
        retries = CounterMetricFamily("velox_retries", "Requests sent again, by reason.",
                                      labels=["reason"])
        for reason, n in zip(RETRY_REASONS, shared.retries.totals(), strict=True):
            retries.add_metric([reason], n)
        yield retries
        tokens = CounterMetricFamily(
            "velox_tokens", "Tokens used, by gateway key ('-': none), route and kind.",
            labels=["key", "route", "kind"])
        for key, route, inp, out in shared.token_rows(self.max_keys):
            tokens.add_metric([key, route, "input"], inp)
            tokens.add_metric([key, route, "output"], out)
        yield tokens
        yield from self._spend()

    def _spend(self) -> Iterator[Metric]:
        """velox_spend_usd_total and velox_spend_unpriced_requests_total: what the model calls
        cost, by gateway key, route and the target that answered (upstream, and the model name
        sent upstream; "*" for a catch-all target that sends the client's own). Read from the
        workers' shared counters (velox.spend.wire counts them as requests settle), so they
        add up to the ledger's cost_usd over the same requests."""
        shared = self.shared
        labels = [(route.model, target.upstream, target.model or
                   (route.model if route.model != "*" else "*"))
                  for route in shared.tables.routes for target in route.targets]
        usd = CounterMetricFamily(
            "velox_spend_usd", "Cost in USD of the model calls priced, by gateway key ('-': "
            "none), route, upstream and upstream model.", labels=["key", *_TARGET_LABELS])
        unpriced = CounterMetricFamily(
            "velox_spend_unpriced_requests", "Model calls whose model has no price (cost "
            "unknown, never counted as 0).", labels=["key", *_TARGET_LABELS])
        for key, target, nanos, unknown in shared.spend_rows(self.max_keys):
            if nanos:
                usd.add_metric([key, *labels[target]], nanos / NANOS_PER_USD)
            if unknown:
                unpriced.add_metric([key, *labels[target]], unknown)
        yield usd
        yield unpriced

    def _embeddings_batches(self) -> Iterator[Metric]:
        """velox_embeddings_batch_*: embeddings batching (velox.batching.batch), all workers."""
        totals = self.shared.counters.totals()
        yield CounterMetricFamily(
            "velox_embeddings_batch_calls",
            "Upstream calls of embeddings-batching routes (a lone request is a batch of one).",
            value=totals[F.EMB_BATCHES])
        yield CounterMetricFamily(
            "velox_embeddings_batch_requests", "Client requests carried by those calls.",
            value=totals[F.EMB_BATCH_MEMBERS])
        left = CounterMetricFamily(
            "velox_embeddings_batch_left",
            "Batches by why they left: nothing in flight, full, or max_wait_ms passed.",
            labels=["reason"])
        left.add_metric(["immediate"], totals[F.EMB_IMMEDIATE_BATCHES])
        left.add_metric(["full"], totals[F.EMB_FULL_BATCHES])
        left.add_metric(["timeout"], totals[F.EMB_TIMEOUT_BATCHES])
        yield left
        yield CounterMetricFamily(
            "velox_embeddings_batch_split_retries",
            "Members sent again alone after their merged call got a 400.",
            value=totals[F.EMB_SPLIT_RETRIES])
        calls = totals[F.EMB_BATCHES]
        yield GaugeMetricFamily(
            "velox_embeddings_batch_size_mean", "Mean client requests per upstream call.",
            value=totals[F.EMB_BATCH_MEMBERS] / calls if calls else 0.0)

    def collect(self) -> Iterator[Metric]:
        # Worker slots (stats.SharedStats): counters and histograms for every slot that has
        # run a worker (they stay cumulative across reloads), gauges for the serving slots only.
        shared = self.shared
        every = shared.counters.snapshot()
        active = set(shared.active_slots())
        ran = [s for s, row in enumerate(every) if row[F.STARTS] or s in active]
        workers = [str(s) for s in ran]
        rows = [every[s] for s in ran]
        serving = [str(s) for s in ran if s in active]
        serving_rows = [every[s] for s in ran if s in active]
        yield from self._requests(ran)
        yield from self._upstreams()
        for field, name, doc in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["worker"])
            for w, row in zip(workers, rows, strict=False):
                family.add_metric([w], row[field])
            yield family
        rejected = CounterMetricFamily(
            "velox_rejected_requests", "Requests the gateway refused before sending upstream.",
            labels=["reason", "worker"])
        for w, row in zip(workers, rows, strict=False):
            rejected.add_metric(["ring_full", w], row[F.REJECT_RING_FULL])
            rejected.add_metric(["rate_limited", w], row[F.REJECT_RATE_LIMITED])
        yield rejected
        mean = GaugeMetricFamily("velox_batch_size_mean",
                                 "Mean micro-batch size since start.", labels=["worker"])
        for w, row in zip(workers, rows, strict=False):
            mean.add_metric([w], row[F.BATCH_ITEMS] / row[F.BATCHES] if row[F.BATCHES] else 0.0)
        yield mean
        for field, name, doc in _GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["worker"])
            for w, row in zip(serving, serving_rows, strict=False):
                gauge.add_metric([w], row[field])
            yield gauge
        starts = CounterMetricFamily("velox_worker_restarts",
                                     "Times the worker in this slot was restarted.",
                                     labels=["worker"])
        for w, row in zip(workers, rows, strict=False):
            starts.add_metric([w], max(0, row[F.STARTS] - 1))
        yield starts
        age = GaugeMetricFamily("velox_worker_heartbeat_age_seconds",
                                "Time since the worker's loop last ticked (-1: not started).",
                                labels=["worker"])
        now = now_ms()
        for w, row in zip(serving, serving_rows, strict=False):
            beat = row[F.HEARTBEAT_MS]
            age.add_metric([w], max(0, now - beat) / 1000 if beat else -1.0)
        yield age
        yield GaugeMetricFamily("velox_ring_capacity", "Capacity of each worker's ring.",
                                value=self.ring_capacity)
        yield from self._rate_limit()
        yield from self._cache()
        yield from self._embeddings_batches()
        yield from self._redis()
        yield from self._histograms(ran)
        runs, profiling = self.profile_runs()
        yield CounterMetricFamily("velox_profile_runs", "Profiles taken via /debug/pprof.",
                                  value=runs)
        yield GaugeMetricFamily("velox_profile_active", "1 while a profile is running.",
                                value=1 if profiling else 0)
        if self.admin_refused is not None:
            yield CounterMetricFamily(
                "velox_admin_connections_refused",
                "Admin connections answered 503 because the connection cap was reached.",
                value=self.admin_refused())
        yield from self._keys()
        yield GaugeMetricFamily("velox_start_time_seconds", "Supervisor start, Unix time.",
                                value=self.started_at)
        yield GaugeMetricFamily("velox_uptime_seconds", "Seconds since the supervisor started.",
                                value=max(0.0, time.time() - self.started_at))
        info = GaugeMetricFamily("velox_info", "Velox version.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info

    def _keys(self) -> Iterator[Metric]:
        """Per gateway key (by name, never the key): admitted, refused by reason, in flight,
        left, tokens used. The first VELOX_METRICS_KEYS keys (the file's in order, then
        run-time keys as made) have their own series; the others are summed under
        key="_other" (no `remaining`: a sum of buckets means nothing)."""
        keys = self.shared.keys
        if not keys.keys and not keys.runtime:
            return
        rows, other = keys.metrics_rows(self.max_keys)
        tokens = CounterMetricFamily(
            "velox_key_tokens", "Tokens the answers of each gateway key used (file and "
            "run-time keys), by kind.", labels=["key", "kind"])
        requests = CounterMetricFamily("velox_key_requests",
                                       "Requests admitted for each gateway key.", labels=["key"])
        refused = CounterMetricFamily(
            "velox_key_refused", "Requests of each gateway key refused, by the limit that did.",
            labels=["key", "reason"])
        active = GaugeMetricFamily("velox_key_active",
                                   "Requests of each gateway key in flight, all workers.",
                                   labels=["key"])
        remaining = GaugeMetricFamily(
            "velox_key_remaining", "What is left in each gateway key's buckets now.",
            labels=["key", "kind"])
        for row in rows + ([{**other, "name": OTHER_KEYS}] if other is not None else []):
            name = row["name"]
            requests.add_metric([name], row["requests"])
            tokens.add_metric([name, "input"], row["tokens_in"])
            tokens.add_metric([name, "output"], row["tokens_out"])
            for reason, n in row["refused"].items():
                refused.add_metric([name, reason], n)
            active.add_metric([name], row["active"])
            if row.get("remaining_requests") is not None:
                remaining.add_metric([name, "requests"], row["remaining_requests"])
            if row.get("remaining_tokens") is not None:
                remaining.add_metric([name, "tokens"], row["remaining_tokens"])
        yield requests
        yield refused
        yield active
        yield remaining
        yield tokens
        yield GaugeMetricFamily(
            "velox_key_series_other", "Gateway keys summed under key=\"_other\" (past "
            "VELOX_METRICS_KEYS).", value=other["keys"] if other is not None else 0)

    def _requests(self, slots: list[int]) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "velox_requests", "Requests answered, by route, status class and worker.",
            labels=["route", "status_class", "worker"])
        every = self.shared.routes.snapshot()
        workers = [str(s) for s in slots]
        rows = [every[s] for s in slots]
        for route, route_name in KIND_NAMES.items():
            fields = KIND_STATUS_FIELD[route]
            for cls_index, cls in enumerate(STATUS_CLASSES):
                field = fields[2 + cls_index]  # indexed by status // 100: 2xx is 2
                for w, row in zip(workers, rows, strict=False):
                    family.add_metric([route_name, cls, w], row[field])
        yield family

    def _rate_limit(self) -> Iterator[Metric]:
        limiter = self.limiter
        bucket = getattr(limiter, "bucket", None)
        limited = bool(getattr(limiter, "enabled", bucket is not None))  # shared mode too
        yield GaugeMetricFamily("velox_ratelimit_enabled", "1 if VELOX_RATE_LIMIT_RPM > 0.",
                                value=1 if limited else 0)
        if not limited:
            return
        yield GaugeMetricFamily("velox_ratelimit_tokens_available",
                                "Tokens in the shared bucket now (with VELOX_REDIS_URL: this "
                                "host's lease).", value=limiter.available())
        yield GaugeMetricFamily("velox_ratelimit_rate_per_minute",
                                "Refill rate of the shared bucket.",
                                value=limiter.rate_per_minute)
        yield GaugeMetricFamily("velox_ratelimit_burst", "Capacity of the shared bucket.",
                                value=limiter.burst)

    def _redis(self) -> Iterator[Metric]:
        """VELOX_REDIS_URL: the host's lease refresher (velox.cluster.leases)."""
        cluster = self.cluster
        if cluster is None:
            return
        m = cluster.metrics()
        yield GaugeMetricFamily("velox_redis_up",
                                "1 while Redis answers; 0: each limit falls back to this "
                                "host's share.", value=m["up"])
        yield GaugeMetricFamily("velox_redis_hosts",
                                "Velox hosts sharing the limits, as last seen in Redis.",
                                value=m["hosts"])
        yield CounterMetricFamily("velox_redis_fallbacks",
                                  "Times Redis became unreachable (limits fell back to the "
                                  "host's share).", value=m["fallbacks"])
        yield CounterMetricFamily("velox_redis_lease_requests",
                                  "Bucket leases asked of Redis.", value=m["lease_requests"])
        yield CounterMetricFamily("velox_redis_leased_tokens",
                                  "Tokens Redis granted to this host.", value=m["leased_tokens"])
        yield CounterMetricFamily("velox_redis_commands",
                                  "Commands sent to Redis (one script call leases every bucket "
                                  "due at once).", value=m["commands"])
        yield CounterMetricFamily("velox_redis_errors", "Redis calls that failed or timed out.",
                                  value=m["errors"])
        yield from _budget_grants(cluster)

    def _cache(self) -> Iterator[Metric]:
        """The response cache (velox.cache): outcomes summed over workers, the store's state."""
        store = self.shared.cache
        yield GaugeMetricFamily("velox_cache_enabled", "1 if the response cache is on.",
                                value=0 if store is None else 1)
        totals = self.shared.counters.totals()
        for field, name, doc in _CACHE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=totals[field])
        if store is None:
            return
        stats = store.stats()
        yield GaugeMetricFamily("velox_cache_entries", "Answers in the cache.",
                                value=stats["entries"])
        yield GaugeMetricFamily("velox_cache_bytes",
                                "Cache memory in use (answers and their overhead).",
                                value=stats["bytes"])
        yield GaugeMetricFamily("velox_cache_capacity_bytes", "VELOX_CACHE_MAX_BYTES.",
                                value=stats["capacity"])
        yield CounterMetricFamily("velox_cache_evictions",
                                  "Answers evicted to make room (least recently used first).",
                                  value=stats["evictions"])
        yield CounterMetricFamily("velox_cache_expired", "Answers dropped past their TTL.",
                                  value=stats["expired"])

    def _histograms(self, slots: list[int]) -> Iterator[Metric]:
        for kind, name, doc in _HISTOGRAMS:
            hist = self.shared.histograms[kind]
            family = HistogramMetricFamily(name, doc, labels=["worker"])
            for slot in slots:
                buckets, total_s = prometheus_buckets(hist, slot)
                family.add_metric([str(slot)], buckets, sum_value=total_s)
            yield family


def prometheus_buckets(hist: Any, slot: int = -1) -> tuple[list[tuple[str, float]], float]:
    """Cumulative (le, count) pairs over LE_BOUNDS_S plus +Inf, and the sum in seconds."""
    native = hist.buckets(slot)
    out: list[tuple[str, float]] = []
    cumulative = 0
    i = 0
    for bound in LE_BOUNDS_S:
        limit_us = bound * 1_000_000
        while i < len(native) and native[i][0] <= limit_us:
            cumulative += native[i][1]
            i += 1
        out.append((_le(bound), cumulative))
    # +Inf from the same bucket snapshot, not count(): writers keep recording meanwhile, and
    # +Inf must never be below a finite bucket.
    out.append(("+Inf", cumulative + sum(n for _, n in native[i:])))
    return out, hist.total_us(slot) / 1_000_000


def _le(bound: float) -> str:
    return f"{bound:g}" if bound >= 0.001 else f"{bound:.5f}".rstrip("0")


def make_registry(collector: VeloxCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


# Budgets across hosts (velox.spend.hosts.BudgetLeases.metrics): name, help, field, counter.
_GRANTS = (
    ("velox_budget_grant_asks", "Asks for a budget's allowance this host sent to Redis.",
     "asked", True),
    ("velox_budget_grants", "Asks Redis granted some allowance.", "granted", True),
    ("velox_budget_grant_refusals", "Asks Redis granted nothing (the budget had nothing "
     "left to allocate, or grants were held after a data loss).", "refused", True),
    ("velox_budget_granted_usd", "USD of allowance Redis granted this host.", "granted_usd",
     True),
    ("velox_budget_allowance_usd", "USD of allowance this host holds unused now.", "held_usd",
     False),
)


def _budget_grants(cluster: Any) -> Iterator[Metric]:
    """The budgets' allowances across hosts, per budget (labels budget and kind)."""
    rows = [row for extra in cluster.extras if hasattr(extra, "metrics")
            for row in extra.metrics()]
    if not rows:
        return
    for name, doc, field, counter in _GRANTS:
        family: CounterMetricFamily | GaugeMetricFamily = \
            CounterMetricFamily(name, doc, labels=("budget", "kind")) if counter else \
            GaugeMetricFamily(name, doc, labels=("budget", "kind"))
        for row in rows:
            family.add_metric((row["budget"], row["kind"]), row[field])
        yield family
