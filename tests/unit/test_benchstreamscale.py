"""The streaming matrix's report (benches/e2e/streamscale.py, benches/report.py): per egress
and stream count, medians over rounds, the delays added to the floor's in the same round, the
ratios to nginx's, the goals' verdicts (developers' page only) and the docs' section.

A small synthetic result file: no gateway is started here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benches import report as benchreport
from benches.e2e import streamscale

from .benchpage import regenerate

MACHINE = {"date": "2026-01-01T00:00:00+00:00", "cpu_model": "Test CPU", "cores": 2,
           "memory_mib": 4096, "os": "TestOS", "kernel": "6.0", "python": "3.11.7",
           "packages": {"uvloop": "0.23.0", "orjson": "3.13.0"}, "git_commit": "abc1234",
           "git_dirty": False, "loadavg": [0.5, 0.4, 0.3]}


def _row(rnd: int, target: str, streams: int, ttfb: tuple[float, float],
         gap: tuple[float, float], cpu: float | None = None, stalls: int = 0,
         wait: float | None = None) -> dict:
    """One measured phase; latencies in µs as drive() gives them; `wait`: the share of time
    the processes waited for a core (the target's, or on the floor's row the bench's own)."""
    row = {"round": rnd, "target": target, "streams": streams, "errors": 0, "events": 1000,
           "stalls": stalls, "ttfb_us": {"p50": ttfb[0], "p99": ttfb[1]},
           "gap_us": {"p50": gap[0], "p99": gap[1]},
           "wait_pct" if cpu is not None else "bench_wait_pct": wait}
    if cpu is not None:
        row |= {"cpu_us_per_event": cpu, "system_us_per_event": cpu / 2,
                "idle_us_per_event": 1.0}
    return row


def _run(egress: str) -> dict:
    """Three rounds; the floor's TTFB 1,000/2,000 µs and gaps 100/500 µs in every round."""
    nginx = "nginx" if egress == "http1" else "nginx-tls"
    rows = []
    for rnd, velox_cpu in enumerate((28.0, 35.0, 30.0)):
        rows += [
            _row(rnd, "direct", 1, (1000, 2000), (100, 500)),
            # nginx adds 0.02 ms to the head and 0.01 ms to the gap: within the noise
            _row(rnd, nginx, 1, (1020, 2020), (100, 510), cpu=50.0),
            _row(rnd, "velox", 1, (1300, 2400), (100, 800), cpu=100.0),
            _row(rnd, "direct", 512, (1000, 2000), (100, 500), wait=10.0 * (rnd + 1)),
            _row(rnd, nginx, 512, (1200, 2500), (100, 1500), cpu=20.0),
            _row(rnd, "velox", 512, (1600, 2900), (100, 2000), cpu=velox_cpu,
                 stalls=1 if rnd == 1 else 0, wait=(5.0, 60.0, 20.0)[rnd]),
        ]
    return {"egress": egress, "events": "20-200", "interval_ms": 20, "seconds": 8,
            "rows": rows, "profiles": []}


def _doc() -> dict:
    return {"machine": MACHINE, "load_start": [1.0, 1.0, 1.0], "load": [2.0, 1.5, 1.0],
            "duration_s": 600, "runs": [_run("http1"), _run("h2")]}


def _by_target(run: dict) -> dict[tuple[str, str], list[str]]:
    rows = streamscale.summary(run)
    assert all(len(r) == len(streamscale.HEADER) for r in rows)
    return {(r[0], r[1]): r for r in rows}


CPU_RATIO = streamscale.HEADER.index("× nginx")


def test_medians_added_delays_and_ratios_to_nginx() -> None:
    rows = _by_target(_run("http1"))
    assert rows[("velox", "512")] == ["velox", "512", "3", "30.0", "15.0", "1.0", "1.50",
                                      "+0.60", "3.00", "+0.90", "1.80", "+0.00", "+1.50",
                                      "1.50", "20", "1", "0"]
    assert rows[("nginx", "512")][CPU_RATIO] == "1.00"
    # the floor's row comes first at each count: no figures of its own but its stalls
    assert [r[0] for r in streamscale.summary(_run("http1"))][:3] == [
        streamscale.FLOOR, "nginx", "velox"]
    # its waiting share is the client's and the mock's (median over rounds)
    assert rows[(streamscale.FLOOR, "512")][3:] == ["–"] * 11 + ["20", "0", "0"]
    # rounds without the figure (a file from before it was kept) show none
    assert rows[("nginx", "512")][-3] == "–" and rows[(streamscale.FLOOR, "1")][-3] == "–"


def test_no_ratio_to_an_added_delay_within_the_noise() -> None:
    one = _by_target(_run("http1"))[("velox", "1")]
    assert one[CPU_RATIO] == "2.00"  # CPU: always a ratio
    assert one[7:11] == ["+0.30", "–", "+0.40", "–"]  # nginx: +0.02 ms, no ratio


def test_over_tls_the_reference_is_nginx_tls() -> None:
    assert _by_target(_run("h2"))[("velox", "512")][CPU_RATIO] == "1.50"


def test_goals_judge_each_count_and_the_noise_floor() -> None:
    got = {(g["streams"], g["goal"]): g["reached"] for g in streamscale.goals(_run("http1"))}
    assert got[(512, "CPU per event <= 1.5x nginx's")] is True
    assert got[(512, "added time to the response head, p50 <= 2.0x nginx's")] is False
    assert got[(512, "added time to the response head, p99 <= 2.0x nginx's")] is True
    assert got[(512, "no stalls")] is False
    assert got[(1, "CPU per event <= 1.5x nginx's")] is False
    # nginx adds 0.01 ms to the gap p99, Velox 0.3: missed against twice the noise floor
    assert got[(1, "added inter-event gap, p99 <= 2.0x nginx's")] is False
    assert (1, "added time to the response head, p50 <= 2.0x nginx's") not in got  # 512 only


def test_a_file_from_before_the_matrix_is_one_run() -> None:
    old = {**_run("http1"), "machine": MACHINE, "load": [1.0, 1.0, 1.0]}
    assert streamscale.runs(old) == [old]
    assert "egress http1" in streamscale.markdown(old)


def test_docs_section_has_a_table_per_egress_and_no_verdicts(tmp_path: Path) -> None:
    text = regenerate(tmp_path, "streamscale", "streamscale.json", _doc())
    assert "old" not in text and "do not edit" in text
    assert text.count("| target | streams |") == 2
    assert "HTTP/1.1 cleartext upstream" in text and "HTTP/2 + TLS upstream" in text
    assert "| velox | 512 | 3 | 30.0 |" in text
    assert "load average 1.00 at the start of the run and 2.00 at its end" in text.lower()
    for internal in ("verdict", "**missed**", "issue 22"):
        assert internal not in text


def test_goals_go_to_the_html_page() -> None:
    secs = benchreport.streamscale_sections(_doc())
    goals = [table for marker, _, table, _ in secs if marker == benchreport.GOALS]
    assert len(goals) == 1 and goals[0] is not None
    head, rows = goals[0]
    assert "**missed**" in {r[head.index("verdict")] for r in rows}


def test_wait_share_of_a_process_and_of_the_host() -> None:
    assert streamscale.wait_pct(0.3, 0.1) == 25.0
    assert streamscale.wait_pct(0.0, 0.0) is None  # nothing wanted a core: no share
    # this process's own schedstat (updated at the scheduler's ticks): it has run, and
    # neither figure goes back
    ran, waited = streamscale._sched(os.getpid())
    again = streamscale._sched(os.getpid())
    assert again[0] >= ran > 0 and again[1] >= waited >= 0


def test_session_weight_writes_the_nice_value_or_says_why_not(tmp_path: Path) -> None:
    autogroup = tmp_path / "autogroup"
    streamscale.session_weight(-10, autogroup)
    assert autogroup.read_text() == "-10\n"
    with pytest.raises(SystemExit, match=r"--session-nice -5: cannot write .*needs root"):
        streamscale.session_weight(-5, tmp_path / "absent" / "autogroup")


def test_event_counts_and_perf_report_parsing() -> None:
    assert streamscale.event_counts("20-200") == (20, 200)
    assert streamscale.event_counts("100") == (100, 100)
    text = ("# Overhead  Shared Object  Symbol\n#\n"
            "    14.30%  [kernel.kallsyms]     [k] finish_task_switch.isra.0\n"
            "     5.70%  libpython3.11.so.1.0  [.] _PyEval_EvalFrameDefault\n\n")
    assert streamscale.parse_perf_report(text) == [
        {"pct": 14.3, "dso": "[kernel.kallsyms]", "symbol": "finish_task_switch.isra.0",
         "space": "kernel"},
        {"pct": 5.7, "dso": "libpython3.11.so.1.0", "symbol": "_PyEval_EvalFrameDefault",
         "space": "user"}]
    objects = ("# Overhead  Shared Object\n#\n    61.20%  [kernel.kallsyms]\n"
               "    20.05%  libpython3.11.so.1.0\n")
    assert streamscale.parse_perf_report(objects) == [
        {"pct": 61.2, "dso": "[kernel.kallsyms]"}, {"pct": 20.05, "dso": "libpython3.11.so.1.0"}]
