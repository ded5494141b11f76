"""The comparison with other gateways: a run's rows reduced to medians over rounds
(benches/e2e/peers.py) and the tables docs/benchmarks.md shows of them (benches/report_peers.py)."""

from __future__ import annotations

import json
from pathlib import Path

from benches import report_peers
from benches.e2e import peers


def _wrk(target: str, conns: int, rnd: int, cpu: float, p50: int, rps: float) -> dict:
    return {"kind": "wrk", "target": target, "conns": conns, "round": rnd, "rps": rps,
            "p50_us": p50, "p99_us": 4 * p50, "server_cpu_us_per_req": cpu,
            "server_pss_peak_kib": 20480, "errors": 0, "calib_before_ms": 90.0 + rnd,
            "calib_after_ms": 100.0 + rnd}


def _scale(target: str, rnd: int, cpu: float, ttfb: float, stalls: int = 0) -> dict:
    return {"kind": "stream_scale", "target": target, "round": rnd, "streams": 64,
            "events_per_stream": 100, "delay_ms": 20.0, "server_cpu_us_per_event": cpu,
            "ttfb_p50_ms": ttfb, "ttfb_p99_ms": ttfb + 1, "gap_excess_p50_ms": 0.1,
            "gap_excess_p99_ms": 0.5, "errors": 0, "stalls": stalls}


ROWS = [
    *[_wrk("direct", c, r, 0.0, 100, 9000.0) for c in (1, 64) for r in (1, 2, 3)],
    # Velox's middle round is an outlier on purpose: the median must ignore it.
    _wrk("velox", 64, 1, 50.0, 900, 20000.0), _wrk("velox", 64, 2, 500.0, 900, 20000.0),
    _wrk("velox", 64, 3, 52.0, 900, 21000.0), _wrk("velox", 1, 1, 120.0, 240, 5000.0),
    *[_wrk("nginx_tls", c, r, 25.0, 120, 30000.0) for c in (1, 64) for r in (1, 2, 3)],
    *[_scale("direct", r, 0.0, 21.0) for r in (1, 2)],
    _scale("velox", 1, 30.0, 21.5), _scale("velox", 2, 40.0, 21.7, stalls=1),
    *[_scale("nginx", r, 20.0, 21.1) for r in (1, 2)],
]


def test_medians_over_rounds_and_summed_stalls() -> None:
    doc = peers.reduce(ROWS)
    assert doc["wrk"]["velox"]["64"]["server_cpu_us_per_req"] == 52.0
    assert doc["wrk"]["velox"]["64"]["rounds"] == 3
    assert doc["scale"]["velox"]["64"]["server_cpu_us_per_event"] == 35.0
    assert doc["scale"]["velox"]["64"]["stalls"] == 1
    assert doc["speed_check"] == {"min_ms": 91.0, "median_ms": 97.0, "max_ms": 103.0}


def test_tables_give_ratios_to_nginx_and_added_times_over_direct() -> None:
    doc = peers.reduce(ROWS)
    head, rows = report_peers.table_load(doc)
    velox = dict(zip(head, rows[0], strict=True))
    assert velox["gateway"] == "Velox" and velox["× nginx-tls @64"] == "2.08×"
    _, one = report_peers.table_one(doc)
    assert one[0][:4] == ["Velox", "120.0", "4.80×", "140"]  # 240 - 100 µs added at p50
    head, rows = report_peers.table_streams(doc, "64")
    velox = dict(zip(head, rows[0], strict=True))
    assert velox["× nginx"] == "1.75×" and velox["+TTFB p99 ms"] == "+0.60"
    assert velox["stalls"] == "1"
    assert [r[0] for r in rows] == ["Velox", "nginx, cleartext"]  # direct is the floor, not a row


def test_a_run_file_with_its_report_beside_it(tmp_path: Path) -> None:
    run = tmp_path / "run.jsonl"
    run.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    run.with_suffix(".md").write_text(
        "# report — 2026-01-02T03:04:05Z\n- envoy: `1.40.0/Clean/RELEASE/BoringSSL (x)`\n"
        "- nginx: `nginx/1.22.1`\n- litellm: `1.0`\n- loadavg_at_end: `1.50 2.00 2.50`\n")
    doc = peers.load(run)
    assert doc["versions"] == {"nginx": "1.22.1", "envoy": "1.40.0", "litellm": "1.0"}
    assert doc["machine"]["date"].startswith("2026-01-02T03:04")
    assert doc["machine"]["loadavg"] == [1.5, 2.0, 2.5]
    intro = " ".join(report_peers.intro(doc))
    assert "nginx 1.22.1" in intro and "LiteLLM" not in intro  # LiteLLM was not in this run
