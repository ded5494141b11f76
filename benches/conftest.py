"""Shared fixtures of the micro-benchmarks, and the hook that saves their figures.

`pytest --benchmark` runs every bench_*.py here; when the session ends, every benchmark's
statistics (seconds per call, as pytest-benchmark measured them) and its `extra_info` (per-item
figures and head-to-head ratios) are written to benches/results/micro.json and micro.csv,
together with the machine facts, so the report and the README can be regenerated from them.
A run of part of the suite updates only the entries it measured. Set VELOX_BENCH_RESULTS to
write elsewhere (the hook writes nothing when no benchmark ran).

The session holds the shared benchmark lock (see benches/e2e/machine.py) while it measures.
pytest loads this file on plain `pytest` runs too (benches/ is a test path), so it imports
nothing heavy and does nothing unless --benchmark is given.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

RESULTS = Path(__file__).parent / "results"
_STATS = ("min", "max", "mean", "stddev", "median", "iqr", "rounds", "ops")
_CSV = ("group", "name", *_STATS, "measured_at", "extra_info")


@pytest.fixture(scope="session")
def mock_upstream() -> Iterator[Any]:
    """The bundled mock upstream over HTTP/2 + TLS (ALPN also offers HTTP/1.1), one process."""
    from velox_lab.mock import MockUpstream

    with MockUpstream(tls=True) as mock:
        yield mock


@pytest.fixture(scope="session", autouse=True)
def _bench_lock(request: pytest.FixtureRequest) -> Iterator[None]:
    """The whole micro-benchmark session (about a minute) runs under the shared benchmark lock,
    so it never overlaps another timed section on this machine."""
    if not request.config.getoption("--benchmark", default=False):
        yield
        return
    from benches.e2e.machine import bench_lock

    with bench_lock():
        yield


def _rows(session: pytest.Session) -> list[dict[str, Any]]:
    bs = getattr(session.config, "_benchmarksession", None)
    rows = []
    for bench in getattr(bs, "benchmarks", None) or []:
        if not bench.stats or not bench.stats.data:
            continue
        stats = bench.stats.as_dict()
        rows.append({
            "group": bench.group, "name": bench.name, "fullname": bench.fullname,
            "params": bench.params, "unit": "seconds per call",
            "stats": {k: stats.get(k) for k in _STATS},
            "extra_info": dict(bench.extra_info),
        })
    return rows


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not session.config.getoption("--benchmark", default=False):
        return
    rows = _rows(session)
    if not rows:
        return
    from benches.e2e.machine import facts

    outdir = Path(os.environ.get("VELOX_BENCH_RESULTS") or RESULTS)
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / "micro.json"
    machine = facts(["aiolimiter"])
    selection = [str(a) for a in session.config.args] or ["benches"]
    # A partial run (one file, one test) replaces only its own entries: the file always holds
    # the latest figure of every benchmark, each stamped with when it was measured.
    previous = json.loads(path.read_text()) if path.exists() else {}
    merged = {b["fullname"]: b for b in previous.get("benchmarks", [])}
    for row in rows:
        row["measured_at"] = machine["date"]
        merged[row["fullname"]] = row
    run = {"date": machine["date"], "selection": selection, "benchmarks": len(rows),
           "exitstatus": int(exitstatus), "git_commit": machine["git_commit"],
           "loadavg": machine["loadavg"]}
    history = [*previous.get("history", []), run]
    doc = {"kind": "velox-micro", "machine": machine, "history": history[-20:],
           "benchmarks": sorted(merged.values(), key=lambda b: b["fullname"])}
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    with (outdir / "micro.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(_CSV)
        for row in doc["benchmarks"]:
            writer.writerow([row["group"], row["name"], *(row["stats"][k] for k in _STATS),
                             row.get("measured_at"), json.dumps(row["extra_info"], sort_keys=True,
                                                                default=str)])
