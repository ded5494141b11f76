"""`python -m benches.e2e.peers RUN.jsonl`: keep a run of the side-by-side comparison with other
gateways (nginx, Envoy, TensorZero, Ferro Labs AI Gateway, LiteLLM, Portkey) as
benches/results/peers.json, the figures `python -m benches.report` turns into docs/benchmarks.md's
"Against other gateways" tables.

The comparison itself is a separate harness (it installs and starts every peer, drives them with
wrk and an asyncio stream client, rounds interleaved); it writes one JSON object per measurement
(`RUN.jsonl`) and a Markdown report beside it (`RUN.md`) whose "Machine and versions" list names
each peer's version. This module reduces the rows to medians over rounds per target and load
level, and copies the versions and the host's speed check: nothing is typed in by hand.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benches.e2e import machine

OUT = Path("benches/results/peers.json")
# The figures kept per wrk run and per stream-scale run (medians over rounds).
WRK_FIELDS = ("rps", "p50_us", "p99_us", "server_cpu_us_per_req", "server_rss_peak_kib",
              "server_pss_peak_kib")
SCALE_FIELDS = ("server_cpu_us_per_event", "ttfb_p50_ms", "ttfb_p99_ms", "gap_excess_p50_ms",
                "gap_excess_p99_ms", "server_rss_mid_kib")
SUMMED = ("errors", "stalls")
# "- name: `value`" lines of the report's versions section worth keeping.
VERSION_KEYS = ("nginx", "envoy", "tensorzero", "ferrogw", "litellm", "portkey", "wrk")


def _median(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _group(rows: Iterable[dict[str, Any]], kind: str, level: str) -> dict[tuple[str, int], list]:
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row.get("kind") == kind:
            groups[(row["target"], int(row[level]))].append(row)
    return groups


def reduce(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds: `wrk[target][conns]` and `scale[target][streams]`, plus the speed
    check's spread (the host's pure-Python loop timed around every wrk run)."""
    wrk: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for (target, conns), runs in _group(rows, "wrk", "conns").items():
        wrk[target][str(conns)] = {f: _median(r.get(f) for r in runs) for f in WRK_FIELDS}
        wrk[target][str(conns)]["rounds"] = len(runs)
        wrk[target][str(conns)]["errors"] = sum(r.get("errors", 0) for r in runs)
    scale: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for (target, streams), runs in _group(rows, "stream_scale", "streams").items():
        entry: dict[str, Any] = {f: _median(r.get(f) for r in runs) for f in SCALE_FIELDS}
        entry.update({f: sum(r.get(f, 0) for r in runs) for f in SUMMED})
        entry.update(rounds=len(runs), events_per_stream=runs[0].get("events_per_stream"),
                     delay_ms=runs[0].get("delay_ms"))
        scale[target][str(streams)] = entry
    checks = sorted(v for r in rows if r.get("kind") == "wrk"
                    for v in (r.get("calib_before_ms"), r.get("calib_after_ms")) if v)
    speed = ({"min_ms": checks[0], "median_ms": statistics.median(checks), "max_ms": checks[-1]}
             if checks else None)
    return {"wrk": dict(wrk), "scale": dict(scale), "speed_check": speed}


def versions(report: str) -> dict[str, str]:
    """The peers' versions from the harness's Markdown report ("- envoy: `1.40.0/...`")."""
    found = dict(re.findall(r"^- ([a-z_]+): `([^`]*)`", report, flags=re.MULTILINE))
    # "nginx/1.22.1", "wrk debian/4.1.0-3+b2", "1.40.0/Clean/RELEASE/BoringSSL (...)": the number
    return {k: re.sub(r"^(nginx/|wrk debian/)", "", found[k]).split("/")[0].split(" (")[0]
            for k in VERSION_KEYS if k in found}


def load(jsonl: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    report = jsonl.with_suffix(".md")
    doc = reduce(rows)
    doc["versions"] = versions(report.read_text()) if report.exists() else {}
    m = re.search(r"(\d{4}-\d\d-\d\dT\d\d:\d\d)", report.read_text()) if report.exists() else None
    facts = machine.facts()
    if m:  # the run's own time, not the import's
        facts["date"] = m.group(1) + ":00+00:00"
    load_end = re.search(r"^- loadavg_at_end: `([\d. ]+)`", report.read_text() if report.exists()
                         else "", flags=re.MULTILINE)
    if load_end:
        facts["loadavg"] = [float(x) for x in load_end.group(1).split()]
    doc["machine"] = facts
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not args[0].endswith(".jsonl"):
        print("usage: python -m benches.e2e.peers RUN.jsonl", file=sys.stderr)
        return 2
    doc = load(Path(args[0]))
    OUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}: {sorted(doc['wrk'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
