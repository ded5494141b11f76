"""What one `/metrics` scrape costs the supervisor with many gateway keys.

The scrape runs in the supervisor's admin thread, the process whose Redis refresher thread
leases tokens for every host (velox.cluster.leases): a scrape holding the GIL for a third of a
second delays the leases by as much. Here: 2,048 `[[key]]` tables (rpm, tpm, max_parallel),
three routes, every key having admitted and been refused requests and used tokens on every
route (the worst case: every per-key series has a value). The collector is the one the admin
server registers (velox.admin.metrics), fed from the same shared memory.

`test_scrape_cost[all]` gives every key its own series (VELOX_METRICS_KEYS=4096, as every
scrape did before the setting); `[default]` the default VELOX_METRICS_KEYS (the first keys in
file order have their own series, the rest are summed under key="_other"). extra_info: the
exposition's bytes and series.

Run: `pytest --benchmark benches/bench_metrics.py -s`.
"""

from __future__ import annotations

import hashlib
import time

import pytest

KEYS, ROUTES = 2048, ("gpt-4o", "gpt-4o-mini", "*")


def collector(max_keys: int):
    from velox.admin.metrics import VeloxCollector, make_registry
    from velox.config.tables import KeySpec, RouteSpec, Tables, TargetSpec, UpstreamSpec
    from velox.core.fields import TOKEN_BLOCK
    from velox.state.stats import SharedStats

    keys = tuple(KeySpec(f"team-{i:04d}", hashlib.sha256(b"%d" % i).hexdigest(), rpm=600,
                         tpm=60_000, max_parallel=8) for i in range(KEYS))
    routes = tuple(RouteSpec(model, (TargetSpec("openai"),)) for model in ROUTES)
    tables = Tables((UpstreamSpec("openai", "https://api.openai.com"),), routes, keys=keys)
    shared = SharedStats(2, tables)
    limits = shared.keys.limits
    width = len(ROUTES)
    for i in range(KEYS):
        assert limits.enter(2 * i, 0, 0)  # one request in flight, one admitted
        shared.keys.counters[0].add(0, i, 3)  # refused three times for rpm
        for r in range(width):  # tokens on every route ((key + 1) x routes + route) x 2
            field = ((i + 1) * width + r) * 2
            shared.tokens[field // TOKEN_BLOCK].add(0, field % TOKEN_BLOCK, 100 + i)
    c = VeloxCollector(shared, None, 4096, time.time(), lambda: (0, False), max_keys=max_keys)
    return make_registry(c)


@pytest.mark.parametrize("which", ["all", "default"])
def test_scrape_cost(benchmark, which: str) -> None:
    from prometheus_client import generate_latest

    from velox.config.settings import Settings

    max_keys = 4096 if which == "all" else Settings().metrics_keys
    registry = collector(max_keys)
    body = generate_latest(registry)
    benchmark.extra_info.update({
        "keys": KEYS, "routes": len(ROUTES), "metrics_keys": max_keys, "bytes": len(body),
        "series": sum(1 for line in body.splitlines() if line and not line.startswith(b"#")),
    })
    benchmark.pedantic(generate_latest, args=(registry,), rounds=5, iterations=1,
                       warmup_rounds=1)
