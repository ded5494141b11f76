"""The docs' "Where Velox's time goes" (benches/report_profile.py, from benches/e2e/profile.py's
profile.json): stages largest first, perf's objects grouped by kind with what its cut left out,
frames without the directories of the machine that ran them, and the section written between
its markers with the machine and date but no commit.

A small synthetic result file: no gateway is started here.
"""

from __future__ import annotations

import json
from pathlib import Path

from benches import report as benchreport
from benches import report_profile

MACHINE = {"date": "2026-01-01T00:00:00+00:00", "cpu_model": "Test CPU", "cores": 2,
           "memory_mib": 4096, "os": "TestOS", "kernel": "6.0", "python": "3.11.7",
           "packages": {"uvloop": "0.23.0", "orjson": "3.13.0"}, "git_commit": "abc1234",
           "git_dirty": False, "loadavg": [3.0, 2.0, 1.0]}


def _result(conns: int, stages: dict[str, float], objects: dict[str, float],
            samples: int = 500) -> dict:
    return {"conns": conns, "rps": 1000.0 * conns, "worker_user_s": 3.0, "worker_system_s": 1.0,
            "perf": {"shares": objects},
            "py_spy": {"samples": samples, "rate_hz": 250, "shares": stages, "top_frames": {
                "run_worker (/srv/build/tree/velox/supervisor.py:600)": 0.4,
                "SSLObject.write (/usr/lib/python3.11/ssl.py:930)": 0.1,
                "ClientConnection.respond (/home/dev/velox/velox/ingress/connection.py:90)": 0.05,
            }}}


def _doc() -> dict:
    return {"machine": MACHINE, "loadavg_start": [1.5, 1.0, 1.0], "seconds": 8.0,
            "egress": "h2", "settings": [],
            "results": [
                _result(64, {"event loop": 0.3, "client write": 0.2, "relay": 0.1},
                        {"libpython3.11.so.1.0": 0.6, "[kernel.kallsyms]": 0.2,
                         "libcrypto.so.3": 0.05, "libssl.so.3": 0.02,
                         "_native.cpython-311-x86_64-linux-gnu.so": 0.1}),
                _result(1, {"event loop": 0.5, "relay": 0.2, "h2 connection": 0.1},
                        {"libpython3.11.so.1.0": 0.5, "[kernel.kallsyms]": 0.3}),
            ]}


def test_stages_in_order_of_the_highest_count_with_every_count_a_column() -> None:
    head, rows = report_profile.table_stages(_doc())
    assert head == ["stage (py-spy)", "1 connection", "64 connections"]
    # 64 connections' order first; a stage seen only at 1 connection after them, "–" at 64
    assert rows == [["event loop", "50%", "30%"], ["client write", "–", "20%"],
                    ["relay", "20%", "10%"], ["h2 connection", "10%", "–"]]


def test_objects_grouped_by_kind_and_the_rest_what_perf_left_out() -> None:
    _, rows = report_profile.table_objects(_doc())
    table = {r[0]: r[1:] for r in rows}
    assert table["OpenSSL"] == ["–", "7%"]  # libcrypto and libssl summed
    assert table["the Python interpreter"] == ["50%", "60%"]
    assert table["Velox's native core"] == ["–", "10%"]
    assert table[report_profile.OTHERS] == ["20%", "3%"]  # 1 - the listed objects
    assert rows[-1][0] == report_profile.OTHERS


def test_frames_keep_no_directory_of_the_machine() -> None:
    head, rows = report_profile.table_frames(_doc())
    assert head[0] == "innermost frame, 1 connection"
    assert rows[0][:2] == ["run_worker (velox/supervisor.py:600)", "40%"]
    assert rows[1][0] == "SSLObject.write (ssl.py:930)"
    assert rows[2][0] == "ClientConnection.respond (velox/ingress/connection.py:90)"
    assert not any("/srv" in c or "/home" in c or "/usr" in c for r in rows for c in r)


def test_the_docs_section_is_written_between_its_markers(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "profile.json").write_text(json.dumps(_doc()))
    page = tmp_path / "benchmarks.md"
    page.write_text("## Where Velox's time goes\n\nkept\n\n<!-- bench:profile:start -->\nold\n"
                    "<!-- bench:profile:end -->\nafter\n")
    assert benchreport.generate_only(results, page, ["profile"]) == ["profile"]
    text = page.read_text()
    block = text.split("<!-- bench:profile:start -->")[1].split("<!-- bench:profile:end -->")[0]
    assert "old" not in block and "kept" in text and text.endswith("after\n")
    assert "Test CPU" in block and "2026-01-01 00:00 UTC" in block
    assert "abc1234" not in block and "issue" not in block.lower()
    assert "Load average 1.50 at the start and 3.00 at the end" in block
    assert "64 connections: 64,000 requests/s in all" in block
    for title in ("By stage", "By shared object", "Where the Python samples"):
        assert f"#### {title}" in block


def test_no_profile_no_section() -> None:
    assert report_profile.sections(None) == []
    assert report_profile.sections({"machine": MACHINE, "results": []}) == []


def test_rounds_pool_their_samples_and_show_their_range(tmp_path: Path) -> None:
    """Two rounds at one count: a stage's share is over both rounds' samples (100 at 20%
    and 300 at 60%: 50%), perf's objects the mean of the rounds, each with the rounds' range;
    equal shares in the order of their names."""
    doc = {**_doc(), "results": [
        _result(64, {"event loop": 0.2, "relay": 0.8}, {"libpython3.11.so.1.0": 0.6},
                samples=100),
        _result(64, {"event loop": 0.6, "relay": 0.4}, {"libpython3.11.so.1.0": 0.4},
                samples=300)]}
    head, rows = report_profile.table_stages(doc)
    assert head == ["stage (py-spy)", "64 connections"]
    assert rows == [["event loop", "50% (20–60)"], ["relay", "50% (40–80)"]]
    _, rows = report_profile.table_objects(doc)
    assert {r[0]: r[1] for r in rows}["the Python interpreter"] == "50% (40–60)"
    _, rows = report_profile.table_frames(doc)
    assert rows[0] == ["run_worker (velox/supervisor.py:600)", "40%"]
    assert "2 rounds with the counts interleaved" in report_profile.intro(doc)[0]
