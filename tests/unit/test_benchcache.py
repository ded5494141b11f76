"""The cache benchmark's arithmetic and report tables (benches/e2e/cache.py, benches/report.py).

Synthetic run records only (no processes, no load); the benchmark itself is `make bench-cache`.
"""

from __future__ import annotations

from benches import report as benchreport
from benches.e2e import cache


def _run(config: str, conns: int, rnd: int, rps: float, p50: float, cpu: float) -> dict:
    return {"section": "cache-hit-path", "round": rnd, "conns": conns, "config": config,
            "target": "velox-cache", "rps": rps, "latency_us": {"p50": p50, "p99": p50 * 4},
            "cpu_us_per_request": cpu, "errors_total": 0, "foreign_cores": 0.01}


def test_sequence_has_the_stated_repeat_ratio_and_is_reproducible() -> None:
    seq = cache.sequence(10_000, 0.8)
    assert seq == cache.sequence(10_000, 0.8)
    repeats = len(seq) - len(set(seq))  # every request but a prompt's first is a repeat
    assert 0.78 < repeats / len(seq) < 0.82
    assert seq[0] == 0 and max(seq) == len(set(seq)) - 1  # new prompts are numbered in order


def test_per_worker_lrus_hit_less_than_one_shared() -> None:
    seq = cache.sequence(5000, 0.8)
    shared = cache.simulate_lru(seq, 1, 1000, 16)
    split = cache.simulate_lru(seq, 2, 1000, 16)
    assert shared == 1 - len(set(seq)) / len(seq)  # 1,000 entries hold every prompt here
    assert split < shared - 0.05


def test_summary_pairs_hits_with_misses_and_judges_goals() -> None:
    runs = []
    for rnd in range(3):
        for conns in (1, 64):
            runs += [_run("direct", conns, rnd, 9000, 100.0 * conns, 80.0),
                     _run("miss", conns, rnd, 2000, 500.0 * conns, 300.0),
                     _run("hit", conns, rnd, 8000, 120.0 * conns, 100.0 + rnd),
                     _run("miss-stored", conns, rnd, 1900, 520.0 * conns, 320.0)]
    s = cache.summarize(runs, None, None)
    assert s["hit_path"]["hit@1"]["cpu_us_per_request"] == 101.0
    assert s["paired"]["64"] == {"rounds": 3, "hit_cpu_ratio": round(101 / 300, 2),
                                 "hit_p50_delta_us": -380 * 64, "hit_rps_ratio": 4.0}
    verdicts = {g["goal"]: g["reached"] for g in s["goals"]}
    assert verdicts["1 conn(s): hit CPU per request below a proxied miss's"] is True
    assert verdicts["1 conn(s): hit p50 below the upstream's own p50"] is False
    head, rows = benchreport.table_cache_hit_path(s)
    assert len(rows) == 8 + 2 and len(head) == len(rows[0])
