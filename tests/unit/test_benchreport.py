"""The benchmark report generator: tables from saved results, README markers, the HTML page.

Synthetic results (no benchmark runs, no plots), so this stays fast; one test reads the saved
results to check the page in docs/ is generated from them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benches import report as benchreport
from benches.e2e import summary

MACHINE = {"date": "2026-01-01T00:00:00+00:00", "cpu_model": "Test CPU", "cores": 2,
           "memory_mib": 4096, "os": "TestOS", "kernel": "6.0", "python": "3.11.7",
           "packages": {"uvloop": "0.23.0", "orjson": "3.13.0"}, "git_commit": "abc1234",
           "git_dirty": False, "loadavg": [0.5, 0.4, 0.3]}


def _run(target: str, conns: int, rnd: int, rps: float, p50: float, section: str = "fixed",
         **extra: object) -> dict:
    lat = {"p50": p50, "p90": p50 * 1.5, "p99": p50 * 3, "p99.9": p50 * 5}
    return {"section": section, "round": rnd, "target": target, "conns": conns, "rps": rps,
            "latency_us": lat, "requests": int(rps * 5), "generator": "wrk",
            "errors_total": 0, "non_2xx": 0, "foreign_cores": 0.01, "target_cores": 1.0,
            "rss_kib": [30 * 1024, 31 * 1024], "cpu_us_per_request": 40.0, **extra}


def _e2e_doc() -> dict:
    runs = []
    for rnd in range(3):
        for conns, scale in ((1, 1), (64, 20)):
            runs += [_run("direct", conns, rnd, 10000 * scale, 50 * scale),
                     _run("velox", conns, rnd, 4000 * scale, 150 * scale),
                     _run("nginx", conns, rnd, 8000 * scale, 70 * scale),
                     _run("litellm", conns, rnd, 100, 9000)]
    runs.append(_run("velox-arch", 64, 0, 20000, 2500, section="arch", config="default"))
    s = summary.summarize(runs, {"rss_kib_start": [30000, 30000], "rss_kib_end": [31000, 31000]})
    return {"machine": MACHINE, "placement": "everything on 2 cores", "notes": [],
            "plan": {"rounds": 3, "duration_s": 5}, "summary": json.loads(json.dumps(s))}


def test_summary_pairs_rounds_and_judges_goals() -> None:
    s = _e2e_doc()["summary"]
    assert s["overhead"]["velox"]["1"]["p50"] == 100  # 150 - 50 in every round
    assert s["overhead"]["nginx"]["1"]["p50"] == 20
    goals = {g["goal"]: g for g in s["goals"]}
    assert goals["added p50 latency at 1 connection <= 2x nginx's"]["reached"] is False
    assert goals["Velox adds <= 150 us at p50 with one connection"]["reached"] is True
    assert goals["requests/s at 64 connections >= 200x LiteLLM's"]["reached"] is True
    assert goals["RSS flat over ~1M requests (soak)"]["reached"] is None


def test_fixed_table_has_one_row_per_target_and_concurrency() -> None:
    head, rows = benchreport.table_fixed(_e2e_doc()["summary"])
    assert [r[0] for r in rows] == ["direct", "direct", "velox", "velox", "nginx", "nginx",
                                    "litellm", "litellm"]
    velox_1 = rows[2]
    assert velox_1[head.index("added p50 µs")] == "100"
    assert velox_1[head.index("req/s")] == "4,000"


def test_readme_markers_are_replaced_and_the_rest_kept(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench:e2e:start -->\nold\n<!-- bench:e2e:end -->\noutro\n")
    found = benchreport.update_readme(readme, {"e2e": "new table\n", "micro": "x\n"})
    text = readme.read_text()
    assert found == ["e2e"]
    assert "old" not in text and "new table" in text
    assert text.startswith("intro\n") and text.endswith("outro\n")


def test_generate_writes_html_and_readme_without_plots(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "e2e.json").write_text(json.dumps(_e2e_doc()))
    micro = {"machine": MACHINE, "benchmarks": [{
        "group": "ring", "name": "test_ring", "stats": {"median": 2e-5},
        "extra_info": {"median_per_item_ns": 20.0, "ratio_vs_deque": 1.5}}]}
    (tmp_path / "micro.json").write_text(json.dumps(micro))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench:micro:start --><!-- bench:micro:end -->\n"
                      "<!-- bench:e2e:start --><!-- bench:e2e:end -->\n")
    monkeypatch.setattr(benchreport, "_draw", lambda *a: set())
    out = benchreport.generate(tmp_path, readme)
    assert sorted(out["readme_markers"]) == ["e2e", "micro"]
    page = (tmp_path / "report.html").read_text()
    assert "Test CPU" in page and "1.50× vs deque" in page
    assert "| velox | 1 | 4,000 |" in readme.read_text()


def test_c_core_figures_get_their_own_table() -> None:
    info = {f"c_ns_{key}": 1.5 + i for i, (key, _, _) in enumerate(benchreport.C_FIGURES)}
    micro = {"machine": MACHINE, "benchmarks": [
        {"group": "C core", "name": "test_c_core_ns_per_op", "stats": {"median": 9.0},
         "extra_info": info},
        {"group": "ring", "name": "test_ring", "stats": {"median": 2e-5},
         "extra_info": {"median_per_item_ns": 20.0}}]}
    _head, rows = benchreport.table_c(micro)  # type: ignore[misc]
    assert rows[0] == ["ring push + pop, one item", "1.50", "<= 25"]
    assert rows[3][1:] == ["4.50", "<= 10"]
    assert [r[1] for r in benchreport.table_micro(micro)[1]] == ["test_ring"]
    assert benchreport.table_c({"benchmarks": micro["benchmarks"][1:]}) is None


def test_scenario_benchmarks_get_tables_not_micro_rows() -> None:
    micro = {"machine": MACHINE, "benchmarks": [
        {"group": "cancel", "name": "test_client_disconnect_cancel_latency",
         "stats": {"median": 9.0},
         "extra_info": {"idle_p50_ms": 0.4, "idle_p90_ms": 1.3, "idle_max_ms": 1.5, "idle_n": 20,
                        "busy_p50_ms": 0.5, "busy_p90_ms": 1.6, "busy_max_ms": 1.7, "busy_n": 20}},
        {"group": "admin", "name": "test_profile_throughput_cost", "stats": {"median": 20.0},
         "extra_info": {"rps_without_profile": 20000, "rps_while_profiling": 15000,
                        "throughput_cost_pct": 25.0, "worker_cpu_us_per_request": 36.0,
                        "worker_cpu_us_per_request_profiling": 72.0}}]}
    assert benchreport.table_micro(micro)[1] == []
    _head, rows = benchreport.table_cancel(micro)  # type: ignore[misc]
    assert rows[0] == ["idle gateway", "0.40", "1.30", "1.50", "20"]
    _, admin = benchreport.table_admin_cost(micro)  # type: ignore[misc]
    assert admin[0][1] == "20,000 / 15,000 (25.0% fewer)"
    assert benchreport.table_bigbody(micro) is None
    titles = [t for _, t, _, _ in benchreport.sections({"micro": micro})]
    assert "Client disconnect to upstream RST_STREAM (`benches/bench_cancel.py`)" in titles


def test_batching_table_and_only_its_readme_block(tmp_path: Path) -> None:
    rows = [{"mode": "off", "conns": 64, "rps": 2000.0, "p50": 23000, "p99": 45000,
             "errors": 0, "upstream_calls_per_request": 1.0, "avg_batch_size": None,
             "rounds": 3},
            {"mode": "on", "conns": 64, "rps": 1500.0, "p50": 40000, "p99": 90000,
             "errors": 0, "upstream_calls_per_request": 0.0625, "avg_batch_size": 16.0,
             "rounds": 3}]
    doc = {"machine": MACHINE, "summary": {"rows": rows},
           "setup": {"mock_latency_ms": 20, "mock_latency_per_input_us": 50,
                     "velox_workers": 2, "rounds": 3, "duration_s": 5},
           "runs": [{"foreign_cores_before": 0.5}, {"foreign_cores_before": 0.1}]}
    head, table = benchreport.table_batching(doc)
    assert head[5] == "upstream calls per request"
    assert table[1][:7] == ["64", "on (max_wait_ms = 20)", "1,500", "40,000", "90,000",
                            "0.062", "16.0"]
    results = tmp_path / "results"
    results.mkdir()
    (results / "batching.json").write_text(json.dumps(doc))
    readme = tmp_path / "README.md"
    untouched = "<!-- bench:e2e:start -->\nkept\n<!-- bench:e2e:end -->\n"
    readme.write_text(untouched + "<!-- bench:batching:start -->\nold\n"
                      "<!-- bench:batching:end -->\n")
    assert benchreport.main(["--results", str(results), "--readme", str(readme),
                             "--only", "batching"]) == 0
    text = readme.read_text()
    assert text.startswith(untouched) and "old" not in text
    assert "| 64 | on (max_wait_ms = 20) | 1,500 |" in text and "median of 0.50 cores" in text


def test_issue12_ratios_against_nginx_with_a_tls_upstream() -> None:
    runs = []
    for rnd in range(3):
        for conns, scale in ((1, 1), (64, 20)):
            runs += [_run("direct", conns, rnd, 10000 * scale, 50 * scale),
                     _run("velox", conns, rnd, 4000 * scale, 150 * scale,
                          cpu_us_per_request=130.0 if conns == 64 else 276.0),
                     _run("nginx", conns, rnd, 9000 * scale, 60 * scale,
                          cpu_us_per_request=12.0),
                     _run("nginx-tls", conns, rnd, 8000 * scale, 90 * scale,
                          cpu_us_per_request=59.0 if conns == 64 else 72.0)]
        runs.append(_run("velox-arch", 64, rnd, 20000, 2500, section="arch",
                         config="egress=http1 cleartext", cpu_us_per_request=30.0))
        for target, ttfb in (("direct", 300), ("velox", 1000), ("nginx-tls", 500)):
            runs.append(_run(target, 512, rnd, 100, 1e6, section="stream-many", mode="stream",
                             ttfb_us={"p50": ttfb, "p99": 2 * ttfb}, stalled=0))
    s = json.loads(json.dumps(summary.summarize(runs, {})))
    goals = {g["goal"]: g for g in s["goals"] if g["source"] == "issue 12"}
    cpu64 = goals["CPU per request at 64 connections <= 1.2x nginx's with a TLS upstream"]
    assert (cpu64["measured"], cpu64["reached"]) == (2.2, False)  # 130 / 59
    cpu1 = goals["CPU per request at 1 connection <= 2.0x nginx's with a TLS upstream"]
    assert cpu1["measured"] == 3.83  # 276 / 72
    clear = goals["CPU per request at 64 connections, HTTP/1.1 cleartext egress, <= 2x nginx's "
                  "with a cleartext upstream"]
    assert (clear["measured"], clear["reached"]) == (2.5, False)  # 30 / 12
    p50 = goals["added p50 latency at 1 connection <= 1.5x nginx's with a TLS upstream"]
    assert p50["measured"] == 2.5  # (150 - 50) / (90 - 50)
    rps = goals["requests/s at 64 connections >= 0.9x nginx's with a TLS upstream"]
    assert (rps["measured"], rps["reached"]) == (0.5, False)
    ttfb = goals["added time to first byte (p50), 512 concurrent streams, <= 2x nginx's with a "
                 "TLS upstream"]
    assert (ttfb["measured"], ttfb["reached"]) == (3.5, False)  # 700 / 200
    doc = {"machine": MACHINE, "placement": "x", "notes": [], "plan": {"rounds": 3,
                                                                      "duration_s": 5},
           "summary": s}
    _, rows = benchreport.table_goals(doc["summary"])
    assert ["issue 12", cpu64["goal"], "2.20 x", "1.20 x", "**missed**"] == rows[-6][:5]
    assert "nginx-tls" in [r[0] for r in benchreport.table_fixed(s)[1]]


def test_a_ratio_to_a_non_positive_overhead_is_not_judged() -> None:
    assert summary._ratio(100.0, -3.0) is None
    assert summary._ratio(100.0, None) is None
    assert summary._ratio(90.0, 60.0) == 1.5


def test_native_section_shows_ratios_in_the_docs_and_goals_on_the_html_page(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def doc(velox_cpu: float) -> dict:
        runs = []
        for rnd in range(3):
            for conns in (1, 64):
                runs += [_run("direct", conns, rnd, 10000, 50),
                         _run("velox", conns, rnd, 4000, 150, cpu_us_per_request=velox_cpu),
                         _run("nginx-tls", conns, rnd, 8000, 90, cpu_us_per_request=60.0)]
        s = json.loads(json.dumps(summary.summarize(runs, {})))
        return {"machine": MACHINE, "placement": "everything on 2 cores", "notes": [],
                "plan": {"rounds": 3, "duration_s": 5}, "summary": s, "runs": runs,
                "loadavg_start": [1.5, 1.0, 0.5]}

    (tmp_path / "e2e-native.json").write_text(json.dumps(doc(90.0)))
    (tmp_path / "e2e-native-before.json").write_text(json.dumps(doc(132.0)))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench:native:start -->\n<!-- bench:native:end -->\n")
    monkeypatch.setattr(benchreport, "_draw", lambda *a: set())
    out = benchreport.generate(tmp_path, readme)
    assert out["readme_markers"] == ["native"]
    text = readme.read_text()
    row = next(line for line in text.splitlines()
               if line.startswith("| CPU per request at 64 connections against nginx's"))
    assert "| 1.50× |" in row  # 90/60
    assert "load average 1.50 at its start" in text
    assert "| nginx-tls | 64 |" in text
    # The user docs carry figures, the machine and the date: no targets, verdicts or commits.
    for internal in ("missed", "reached", "<= 1.2x", "issue", "commit", MACHINE["git_commit"]):
        assert internal not in text, internal
    page = (tmp_path / "report.html").read_text()
    assert "**missed**" in page or "missed" in page  # the goals stay on the developers' page
    assert "2.20×" in page  # with the run before, 132/60


def test_docs_benchmarks_page_holds_the_tables_of_the_saved_results(tmp_path: Path) -> None:
    """docs/benchmarks.md is what `python -m benches.report` makes of benches/results/, with
    no goals, verdicts or commits in it."""
    root = Path(__file__).resolve().parents[2]
    page = root / "docs" / "benchmarks.md"
    fresh = tmp_path / "benchmarks.md"
    fresh.write_text(page.read_text())
    benchreport.generate_only(root / "benches" / "results", fresh, list(benchreport.MARKERS))
    assert fresh.read_text() == page.read_text(), (
        "regenerate: python -m benches.report --only " + ",".join(benchreport.MARKERS))
    for internal in ("**missed**", "verdict", "issue ", "commit "):
        assert internal not in page.read_text(), internal
