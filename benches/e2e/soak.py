"""The soak run (`make bench-soak`): about a million requests through one Velox, memory sampled.

Velox (2 workers, HTTP/2 + TLS egress to the mock) takes blocks of wrk load at 64 connections,
with a block of streamed requests every few blocks, until `requests` non-streaming requests have
been served. After every block the RSS of each worker is read (and its PSS: RSS counts whole the
pages a worker shares with its parent and siblings). "Flat" is judged on the second
half of the run, after allocator pools and caches have filled: the growth of the largest worker
between the first and last sample of that half, and the slope of a least-squares line through
it, in MiB per 100,000 requests. Each block runs under the shared benchmark lock.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benches.e2e import results
from benches.e2e.bench import Bench, Plan
from benches.e2e.machine import bench_lock, pss_kib, rss_kib, wait_quiet

BLOCK_S = 10
STREAM_EVERY = 5


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=False)) / den if den else 0.0


def analyse(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Growth and slope of the largest worker's RSS over the second half of the samples."""
    if not samples:
        return {}
    half = samples[len(samples) // 2:]
    xs = [s["requests"] / 100_000 for s in half]
    ys = [max(s["rss_mib"]) for s in half]
    return {
        "samples": len(samples), "requests": samples[-1]["requests"],
        "rss_mib_first": samples[0]["rss_mib"], "rss_mib_last": samples[-1]["rss_mib"],
        "max_worker_rss_mib": max(max(s["rss_mib"]) for s in samples),
        "max_worker_pss_mib": max(max(s.get("pss_mib") or [0]) for s in samples),
        "growth_mib": round(ys[-1] - ys[0], 2),
        "slope_mib_per_100k": round(_slope(xs, ys), 3),
    }


def run(total: int, logdir: Path, outdir: Path = results.RESULTS) -> dict[str, Any]:
    plan = Plan(rounds=1, sections=(), litellm=False)
    bench = Bench(plan, logdir)
    samples: list[dict[str, Any]] = []
    served = blocks = 0
    t0 = time.monotonic()
    try:
        bench.start()
        velox = bench.services["velox"]

        def sample() -> None:
            samples.append({"requests": served, "seconds": round(time.monotonic() - t0, 1),
                            "rss_mib": [round(rss_kib(p) / 1024, 2) for p in velox.workers],
                            "pss_mib": [round(pss_kib(p) / 1024, 2) for p in velox.workers]})

        sample()
        while served < total:
            with bench_lock():
                wait_quiet(bench.own_roots())
                plan.duration_s, plan.warmup_s = BLOCK_S, 0
                bench.run_wrk({"section": "soak", "round": blocks}, "velox", 64)
                if blocks % STREAM_EVERY == STREAM_EVERY - 1:
                    plan.duration_s = 5
                    bench.run_loadgen({"section": "soak-stream", "round": blocks}, "velox",
                                      "stream", 64)
                # Every request counts, including those of runs repeated for foreign load.
                served = bench.requests_served
            blocks += 1
            sample()
            print(f"soak: {served:,} requests, worker RSS {samples[-1]['rss_mib']} MiB", flush=True)
    finally:
        bench.stop()
    analysis = analyse(samples)
    doc = results.document("velox-soak", plan, bench.runs, analysis, bench.notes,
                           {"samples": samples, "seconds": round(time.monotonic() - t0, 1)})
    results.write("soak", doc, bench.runs, outdir)
    return analysis
