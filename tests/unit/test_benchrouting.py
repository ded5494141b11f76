"""The routing benchmark's arithmetic and report tables (benches/e2e/routing.py, benches/report.py).

Synthetic run records only (no processes, no load), so this stays fast; the benchmark itself is
`make bench-routing`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benches import report as benchreport
from benches.e2e import routing

MACHINE = {"date": "2026-01-01T00:00:00+00:00", "cpu_model": "Test CPU", "cores": 2,
           "memory_mib": 4096, "os": "TestOS", "kernel": "6.0", "python": "3.11.7",
           "packages": {"uvloop": "0.23.0", "orjson": "3.13.0"}, "git_commit": "abc1234",
           "git_dirty": False, "loadavg": [0.5, 0.4, 0.3]}


def _run(section: str, target: str, rnd: int, rps: float, p99: float, cpu: float,
         config: str | None = None, errors: int = 0) -> dict:
    return {"section": section, "round": rnd, "target": target, "config": config, "rps": rps,
            "latency_us": {"p50": p99 / 4, "p90": p99 / 2, "p99": p99, "p99.9": p99 * 2},
            "requests": int(rps * 5), "errors_total": errors, "non_2xx": errors,
            "foreign_cores": 0.02, "cpu_us_per_request": cpu, "upstream_cpu_us_per_request": 30.0}


def _runs() -> list[dict]:
    runs = []
    for rnd, (one, three) in enumerate(((10000, 9400), (9000, 8900), (11000, 10600))):
        runs.append(_run("routing-spread", "velox-1", rnd, one, 8000, 50.0))
        runs.append(_run("routing-spread", "velox-3", rnd, three, 8500, 52.0 + rnd))
        runs.append(_run("routing-failover", "velox-failover", rnd, 9000, 9000, 55.0, "all-up"))
        runs.append(_run("routing-failover", "velox-failover", rnd, 8100, 12000, 60.0, "b-503",
                         errors=1 if rnd == 2 else 0))
        runs[-1]["gateway_retries"] = {"status": 5 + rnd, "connect": 1}
        runs.append(_run("routing-failover", "velox-failover", rnd, 8550, 10000, 58.0,
                         "b-killed"))
    return runs


def test_summary_pairs_rounds_and_judges_the_issue_targets() -> None:
    s = routing.summarize(_runs())
    p = s["spread_vs_one"]
    assert p["rps_ratios"] == [0.94, 0.989, 0.964]
    assert p["rps_ratio"] == 0.964  # the median of the per-round ratios, not of the medians
    assert p["cpu_deltas_us"] == [2.0, 3.0, 4.0] and p["cpu_delta_us"] == 3.0
    assert s["spread"]["velox-3"]["rps"] == 9400 and s["spread"]["velox-1"]["runs"] == 3
    goals = {g["goal"]: g for g in s["goals"]}
    assert goals["3 upstreams: throughput vs 1 upstream"]["reached"] is True
    assert goals["3 upstreams: CPU per request minus 1 upstream's"]["reached"] is True
    # One error in one round of the 503 case is a miss: the target is zero.
    assert goals["b-503: client-visible errors"]["measured"] == 1
    assert goals["b-503: client-visible errors"]["reached"] is False
    assert goals["b-killed: client-visible errors"]["reached"] is True
    assert s["failover"]["b-503"]["retries"] == 5 + 6 + 7 + 3
    assert s["failover"]["all-up"]["retries"] == 0
    f = s["failover_vs_all_up"]
    assert f["b-503"]["rps_ratio"] == 0.9 and f["b-503"]["p99_delta_us"] == 3000
    assert f["b-killed"]["rps_ratio"] == 0.95


def test_a_miss_is_reported_as_a_miss() -> None:
    runs = [_run("routing-spread", "velox-1", 0, 10000, 8000, 50.0),
            _run("routing-spread", "velox-3", 0, 9000, 8000, 54.5)]
    goals = {g["goal"]: g for g in routing.summarize(runs)["goals"]}
    assert goals["3 upstreams: throughput vs 1 upstream"]["measured"] == 0.9
    assert goals["3 upstreams: throughput vs 1 upstream"]["reached"] is False
    assert goals["3 upstreams: CPU per request minus 1 upstream's"]["measured"] == 4.5
    assert goals["3 upstreams: CPU per request minus 1 upstream's"]["reached"] is False
    _, rows = benchreport.table_routing_goals(routing.summarize(runs))
    assert [r[3] for r in rows] == ["**missed**", "**missed**"]


def test_the_connections_control_is_paired_with_both_sides() -> None:
    runs = [_run("routing-spread", "velox-1", 0, 10000, 8000, 50.0),
            _run("routing-spread", routing.CONTROL, 0, 9000, 8000, 60.0),
            _run("routing-spread", "velox-3", 0, 8550, 8000, 61.0)]
    s = routing.summarize(runs)
    assert s["control_vs_one"]["rps_ratio"] == 0.9 and s["control_vs_one"]["cpu_delta_us"] == 10
    assert s["spread_vs_control"]["rps_ratio"] == 0.95
    assert s["spread_vs_control"]["cpu_delta_us"] == 1
    assert list(s["spread"]) == ["velox-1", "velox-3", routing.CONTROL]
    _, rows = benchreport.table_routing_spread(s)
    assert rows[-1][:2] == ["3 upstreams against 1 with 3 connections (paired by round, median)",
                            "× 0.950"]


def test_config_names_every_upstream_with_its_weight(tmp_path: Path) -> None:
    class FakeMock:
        def __init__(self, port: int) -> None:
            self.origin, self.ca_file = f"https://127.0.0.1:{port}", "/certs/ca.pem"

    mocks = routing.Mocks(tmp_path, 1)
    mocks.mocks = {n: FakeMock(9000 + i) for i, n in enumerate(routing.NAMES)}  # type: ignore[misc]
    import tomllib

    doc = tomllib.loads(routing.config_text(mocks, routing.NAMES))
    assert [u["name"] for u in doc["upstream"]] == ["a", "b", "c"]
    assert doc["route"][0]["targets"] == [{"upstream": "a", "weight": 2},
                                          {"upstream": "b", "weight": 1},
                                          {"upstream": "c", "weight": 1}]
    control = tomllib.loads(routing.config_text(mocks, routing.NAMES[:1], connections=3))
    assert control["upstream"][0]["connections"] == 3
    assert "connections" not in doc["upstream"][0]  # the default pool unless asked
    one = tomllib.loads(routing.config_text(mocks, routing.NAMES[:1]))
    assert len(one["upstream"]) == 1 and one["route"][0]["targets"] == [
        {"upstream": "a", "weight": 2}]


BALANCE = {
    "kind": "velox-balance", "measured_at": "2026-01-01T00:00:00+0000", "loadavg": [1.0, 1, 1],
    "hash_used": "rendezvous", "target_ns": 2000,
    "hash_quality": [
        {"method": "ring", "targets": 3, "max_over_mean": 1.09, "min_over_mean": 0.93,
         "moved_on_remove": 0.36, "ideal_on_remove": 0.3333, "moved_on_add": 0.22,
         "ideal_on_add": 0.25, "lookup_ns": 591.0},
        {"method": "rendezvous", "targets": 3, "max_over_mean": 1.001, "min_over_mean": 0.998,
         "moved_on_remove": 0.3337, "ideal_on_remove": 0.3333, "moved_on_add": 0.2475,
         "ideal_on_add": 0.25, "lookup_ns": 125.2}],
    "weighted_3_to_1_share": {"rendezvous": 0.7514, "ring": 0.7605},
    "timed_medians_ns_per_item": {"breaker_check": 64.8, "select_weighted": 4246.5},
    "timed_minima_ns_per_item": {"breaker_check": 59.7, "select_weighted": 3986.7},
    "quiet_estimate_ns_per_item": {"breaker_check": 22.6, "select_weighted": 1510.3},
}


def test_generate_writes_the_routing_block_between_its_markers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = {"machine": MACHINE, "placement": "everything on 2 cores", "notes": ["a note"],
           "plan": {"rounds": 3, "duration_s": 5}, "conns": 64,
           "summary": json.loads(json.dumps(routing.summarize(_runs())))}
    (tmp_path / "routing.json").write_text(json.dumps(doc))
    (tmp_path / "balance.json").write_text(json.dumps(BALANCE))
    readme = tmp_path / "README.md"
    readme.write_text("top\n<!-- bench:routing:start -->\nold\n<!-- bench:routing:end -->\nend\n")
    monkeypatch.setattr(benchreport, "_draw", lambda *a: set())
    out = benchreport.generate(tmp_path, readme)
    assert out["readme_markers"] == ["routing"]
    text = readme.read_text()
    assert "old" not in text and text.startswith("top\n") and text.endswith("end\n")
    assert "| Velox, 3 upstreams (weights 2:1:1) | 9,400 |" in text
    assert "| 3 upstreams against 1 (paired by round, median) | × 0.964 |" in text
    assert "| b answers 503 | 8,100 | 0.900 |" in text
    assert "| rendezvous (used) | 3 | 1.0010 | 0.9980 | 0.3337 (0.3333) |" in text
    assert "| select_weighted | 4,246.5 | 3,986.7 | 1,510.3 |" in text
    # The select_* rows come first: they are the per-request figure the issue sets a target for.
    assert text.index("select_weighted") < text.index("| breaker_check")
    assert "a note" in text
    assert "Three upstreams against one" in (tmp_path / "report.html").read_text()


def test_balance_alone_still_fills_the_routing_block(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "balance.json").write_text(json.dumps(BALANCE))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench:routing:start --><!-- bench:routing:end -->\n")
    monkeypatch.setattr(benchreport, "_draw", lambda *a: set())
    assert benchreport.generate(tmp_path, readme)["readme_markers"] == ["routing"]
    text = readme.read_text()
    assert "| ring | 3 | 1.0900 |" in text and "Route selection measured 2026-01-01 00:00" in text
