"""Writing results: one JSON document (machine facts, plan, summary, every raw run) and a CSV
with one row per run, side by side in benches/results/.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from typing import Any

from benches.e2e import litellm
from benches.e2e.machine import facts, tool_version

RESULTS = Path(__file__).resolve().parents[1] / "results"

CSV_FIELDS = (
    "section", "round", "config", "target", "generator", "mode", "conns", "rate", "slow",
    "requests", "rps", "p50", "p90", "p99", "p99.9", "max", "ttfb_p50", "ttfb_p99", "errors",
    "non_2xx", "stalled", "cpu_us_per_request", "upstream_cpu_us_per_request", "target_cores",
    "upstream_cores", "generator_cores", "foreign_cores", "max_rss_mib", "attempt",
)


def tools() -> dict[str, str]:
    return {"wrk": tool_version(["wrk", "-v"]), "nginx": tool_version(["nginx", "-v"]),
            "litellm": litellm.pinned_version() if litellm.installed() else ""}


def placement(plan: Any) -> str:
    return (f"Velox: {plan.velox_workers} workers, pinned one per core (VELOX_PIN_WORKERS=1, the "
            "default), supervisor unpinned. Not pinned, placed by the kernel on the same 2 cores: "
            f"the mock upstream ({plan.mock_workers} process each for TLS and cleartext), nginx "
            f"({plan.nginx_workers} workers), LiteLLM (1 worker), wrk (1 thread) and the project's "
            "load generator (1 process). Everything talks over 127.0.0.1.")


def flat(run: dict[str, Any]) -> dict[str, Any]:
    row = {k: run.get(k) for k in CSV_FIELDS}
    errors = run.get("errors")
    row["errors"] = run.get("errors_total", errors if isinstance(errors, int) else 0)
    lat = run.get("latency_us") or {}
    for p in ("p50", "p90", "p99", "p99.9", "max"):
        row[p] = lat.get(p)
    ttfb = run.get("ttfb_us") or {}
    row["ttfb_p50"], row["ttfb_p99"] = ttfb.get("p50"), ttfb.get("p99")
    rss = run.get("rss_kib") or []
    row["max_rss_mib"] = round(max(rss) / 1024, 1) if rss else None
    return row


def write(name: str, doc: dict[str, Any], runs: list[dict[str, Any]], outdir: Path = RESULTS
          ) -> tuple[Path, Path]:
    outdir.mkdir(parents=True, exist_ok=True)
    js, cs = outdir / f"{name}.json", outdir / f"{name}.csv"
    js.write_text(json.dumps(doc, indent=1, default=_default) + "\n")
    with cs.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for run in runs:
            writer.writerow(flat(run))
    return js, cs


def _default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)  # type: ignore[arg-type]
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def document(kind: str, plan: Any, runs: list[dict[str, Any]], summary: dict[str, Any],
             notes: list[str], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"kind": kind, "machine": facts(), "tools": tools(), "placement": placement(plan),
            "plan": dataclasses.asdict(plan), "notes": notes, **(extra or {}),
            "summary": summary, "runs": runs}
