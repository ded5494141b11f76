"""`GET /stats`: one JSON document for people and scripts, durations in µs with the unit in the key.

Everything but the `state` of each worker comes from shared memory (counters, histograms, the
token bucket), like /metrics. `state` (the worker's upstream pool per connection, its client
connections, what it holds in flight) can only come from the worker, over the control channel;
all workers are asked at once and given `STATE_TIMEOUT_S` together. A worker whose loop is too
busy to answer in that time is reported as `"busy"` instead of holding the response up.
"""

from __future__ import annotations

import time
from typing import Any

from velox import __version__
from velox.admin.control import ControlError, ControlHub, ControlTimeout
from velox.core.clock import now_ms
from velox.core.fields import (
    KIND_NAMES,
    KIND_STATUS_FIELD,
    RETRY_REASONS,
    STATUS_CLASSES,
    UPSTREAM_CLASSES,
    F,
    H,
)
from velox.state.stats import SharedStats

STATE_TIMEOUT_S = 0.25
QUANTILES = ((0.5, "p50_us"), (0.9, "p90_us"), (0.99, "p99_us"), (0.999, "p999_us"))


def latency(hist: Any, slot: int = -1) -> dict[str, Any]:
    count = hist.count(slot)
    out: dict[str, Any] = {"count": count,
                           "mean_us": round(hist.total_us(slot) / count) if count else 0}
    values = hist.percentiles([q for q, _ in QUANTILES], slot)
    out.update({key: value for (_, key), value in zip(QUANTILES, values, strict=False)})
    return out


def worker_states(hub: ControlHub | None, slots: list[int],
                  timeout: float = STATE_TIMEOUT_S) -> dict[int, Any]:
    if hub is None:
        return dict.fromkeys(slots, "unavailable")
    answers = hub.call_each(slots, "state", timeout)
    out: dict[int, Any] = {}
    for slot, answer in answers.items():
        if isinstance(answer, ControlTimeout):
            out[slot] = "busy"
        elif isinstance(answer, ControlError):
            out[slot] = f"unavailable: {answer}"
        else:
            out[slot] = answer
    return out


def build(shared: SharedStats, limiter: Any, settings: Any, hub: ControlHub | None,
          started_at: float, profile_runs: int, profile_active: bool,
          cluster: Any = None) -> dict[str, Any]:
    """The /stats document. `started_at` is the supervisor's start in time.time()."""
    rows = shared.counters.snapshot()
    totals = shared.counters.totals()
    routes = shared.routes.totals()
    hists = shared.histograms
    serving = shared.active_slots()  # a reload's starting or draining workers are not listed
    states = worker_states(hub, serving)

    by_route = {}
    for route, name in KIND_NAMES.items():
        fields = KIND_STATUS_FIELD[route]
        by_route[name] = sum(routes[fields[2 + i]] for i in range(len(STATUS_CLASSES)))
    bucket = getattr(limiter, "bucket", None)
    limited = bool(getattr(limiter, "enabled", bucket is not None))  # shared (Redis) mode too
    now = now_ms()  # the clock the workers' heartbeats use
    workers = []
    for slot in serving:
        row = rows[slot]
        workers.append({
            "worker": slot,
            "pid": row[F.PID],
            "core": row[F.CORE],
            "numa_node": row[F.NUMA_NODE],
            "ready": bool(row[F.READY]),
            "restarts": max(0, row[F.STARTS] - 1),
            "heartbeat_age_ms": now - row[F.HEARTBEAT_MS] if row[F.HEARTBEAT_MS]
            else None,
            "hang_kills": row[F.HANG_KILLS],
            "keys_version": row[F.KEYS_VERSION],
            "requests": row[F.REQUESTS],
            "in_flight": row[F.IN_FLIGHT],
            "ring_depth": row[F.RING_DEPTH],
            "upstream_connections": row[F.UPSTREAM_CONNECTIONS],
            "timer_wakes": row[F.TIMER_WAKES],
            "latency_total": latency(hists[H.TOTAL], slot),
            "state": states.get(slot, "unavailable"),
        })
    return {
        "version": __version__,
        "uptime_s": round(max(0.0, time.time() - started_at), 3),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started_at)),
        "requests": {
            "total": totals[F.REQUESTS],
            "by_status_class": {"2xx": totals[F.RESP_2XX], "3xx": totals[F.RESP_3XX],
                                "4xx": totals[F.RESP_4XX], "5xx": totals[F.RESP_5XX]},
            "by_route": by_route,
            "bytes_in": totals[F.BYTES_IN],
            "bytes_out": totals[F.BYTES_OUT],
            # connections aborted for taking none of their answer (VELOX_WRITE_TIMEOUT_MS)
            "write_timeouts": totals[F.WRITE_TIMEOUTS],
        },
        "latency": {
            "total": latency(hists[H.TOTAL]),
            "overhead": latency(hists[H.OVERHEAD]),
            "upstream": latency(hists[H.UPSTREAM]),
        },
        "ring": {"depth": totals[F.RING_DEPTH], "capacity": settings.ring_depth,
                 "rejected_full": totals[F.REJECT_RING_FULL]},
        "batches": {
            "total": totals[F.BATCHES],
            "mean_size": round(totals[F.BATCH_ITEMS] / totals[F.BATCHES], 2)
            if totals[F.BATCHES] else 0.0,
            "full": totals[F.BATCHES_FULL],
            "max_size": settings.batch_max,
            "embeddings": embeddings_batches(totals),
        },
        "rate_limit": {
            "enabled": limited,
            "rpm": limiter.rate_per_minute if limited else None,
            "burst": limiter.burst if limited else None,
            "available": limiter.available() if limited else None,
            "rejected": totals[F.REJECT_RATE_LIMITED],
        },
        "upstream": {
            "origin": settings.upstream_origin,
            "connections": totals[F.UPSTREAM_CONNECTIONS],
            "in_flight": totals[F.IN_FLIGHT],
            "responses": totals[F.UPSTREAM_REQUESTS],
            "errors": totals[F.UPSTREAM_ERRORS],
            "goaways": totals[F.GOAWAYS],
            "reconnects": totals[F.RECONNECTS],
            "retries": totals[F.RETRIES],
            "streams_cancelled": totals[F.STREAMS_CANCELLED],
        },
        "restarts": sum(max(0, rows[slot][F.STARTS] - 1) for slot in serving),
        "hang_kills": totals[F.HANG_KILLS],
        "access_log": {"enabled": settings.access_log, "lines": totals[F.ACCESS_LOG_LINES],
                       "dropped": totals[F.ACCESS_LOG_DROPPED]},
        "profiles": {"runs": profile_runs, "active": profile_active},
        "upstreams": upstreams(shared),
        "routes": routes_doc(shared),
        "retries": dict(zip(RETRY_REASONS, shared.retries.totals(), strict=True)),
        "retry_budget": shared.health.snapshot()["retry_budget"],
        "workers": workers,
        "cache": cache_doc(shared, totals),
        "keys": shared.keys.snapshot(),
        "runtime_keys": shared.keys.runtime_snapshot(),  # made through the admin API
        "tokens": [{"key": key, "route": route, "input": inp, "output": out}
                   for key, route, inp, out in shared.token_rows()],
        # VELOX_REDIS_URL: the refresher's state (velox.cluster.leases.Cluster.metrics); else None.
        "redis": cluster.metrics() if cluster is not None else None,
    }


def cache_doc(shared: SharedStats, totals: list[int]) -> dict[str, Any]:
    """The response cache (velox.cache.front): outcomes from the counters, the store's own state.
    hit_rate: the share of cacheable requests answered without an upstream call of their own
    (hits and coalesced over hits, coalesced and misses; bypasses are not lookups)."""
    hits, misses = totals[F.CACHE_HITS], totals[F.CACHE_MISSES]
    coalesced = totals[F.CACHE_COALESCED]
    answered = hits + coalesced
    store = shared.cache.stats() if shared.cache is not None else {}
    return {
        "enabled": shared.cache is not None,
        "hits": hits,
        "misses": misses,
        "bypasses": totals[F.CACHE_BYPASSES],
        "coalesced": coalesced,
        "hit_rate": round(answered / (answered + misses), 4) if answered + misses else 0.0,
        "stores": totals[F.CACHE_STORES],
        "sent_alone": totals[F.CACHE_ALONE],
        "followers_cut": totals[F.CACHE_FOLLOWERS_CUT],
        "entries": store.get("entries", 0),
        "bytes": store.get("bytes", 0),
        "capacity": store.get("capacity", 0),
        "evictions": store.get("evictions", 0),
        "expired": store.get("expired", 0),
        "latency_hit": latency(shared.histograms[H.CACHE_HIT]),
        # The Redis tier (velox.cache.redis; zeros without VELOX_REDIS_URL): redis_hits are
        # also in hits; redis_errors: requests that went on without Redis's answer.
        "redis_hits": totals[F.CACHE_REDIS_HITS],
        "redis_misses": totals[F.CACHE_REDIS_MISSES],
        "redis_errors": totals[F.CACHE_REDIS_ERRORS],
        "redis_stores": totals[F.CACHE_REDIS_STORES],
        "redis_dropped": totals[F.CACHE_REDIS_DROPPED],
    }


def embeddings_batches(totals: list[int]) -> dict[str, Any]:
    """Embeddings batching (velox.batching.batch), all workers: upstream calls of batching routes
    (a lone request is a batch of one), members per call, why merged calls left, and members
    sent again alone after a 400."""
    calls = totals[F.EMB_BATCHES]
    return {
        "total_batches": calls,
        "avg_batch_size": round(totals[F.EMB_BATCH_MEMBERS] / calls, 2) if calls else 0.0,
        "timeout_batches": totals[F.EMB_TIMEOUT_BATCHES],
        "full_batches": totals[F.EMB_FULL_BATCHES],
        "immediate_batches": totals[F.EMB_IMMEDIATE_BATCHES],
        "requests": totals[F.EMB_BATCH_MEMBERS],
        "split_retries": totals[F.EMB_SPLIT_RETRIES],
    }


def upstreams(shared: SharedStats) -> list[dict[str, Any]]:
    """Per upstream: its breaker, in-flight gauge, counters and latency (shared memory only)."""
    live = shared.health.snapshot()
    status = shared.upstream_status.totals()
    width = len(UPSTREAM_CLASSES)
    out = []
    for u, spec in enumerate(shared.tables.upstreams):
        row: dict[str, Any] = {"name": spec.name, "origin": spec.origin, "kind": spec.kind}
        row.update(live["upstreams"][spec.name])
        row["by_status_class"] = dict(zip(UPSTREAM_CLASSES, status[u * width:(u + 1) * width],
                                          strict=True))
        row["latency"] = latency(shared.upstream_latency[u])
        tpm = shared.health.tpm
        row["tpm"] = spec.tpm
        row["tpm_available"] = tpm.level(u) if tpm is not None and spec.tpm else None
        out.append(row)
    return out


def routes_doc(shared: SharedStats) -> list[dict[str, Any]]:
    """Per route: each target's picks and its share of the route's traffic."""
    picks = shared.targets.totals()
    out: list[dict[str, Any]] = []
    index = 0
    for route in shared.tables.routes:
        counts = picks[index:index + len(route.targets)]
        total = sum(counts)
        out.append({
            "model": route.model, "strategy": route.strategy,
            "fallbacks": list(route.fallbacks),
            "targets": [{"upstream": t.upstream, "model": t.model or None,
                         "weight": t.weight, "priority": t.priority, "picks": n,
                         "share": round(n / total, 4) if total else 0.0}
                        for t, n in zip(route.targets, counts, strict=True)],
        })
        index += len(route.targets)
    return out
