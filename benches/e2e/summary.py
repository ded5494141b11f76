"""From the raw runs to the figures the README and the report show (pure functions, no I/O).

Every figure is a median over rounds. Overheads are paired: in each round the target's
percentile minus direct's percentile from the same round (the two were measured minutes apart
at most), then the median of those differences; throughput ratios likewise. The goals of the
gateway and benchmark issues are evaluated here from the same medians, so the report only
renders what this module computed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from statistics import median
from typing import Any

PCTS = ("p50", "p90", "p99", "p99.9")
Run = dict[str, Any]


def _med(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(median(vals), 2) if vals else None


def _group(runs: list[Run], section: str, key: str) -> dict[tuple, list[Run]]:
    out: dict[tuple, list[Run]] = defaultdict(list)
    for r in runs:
        if r["section"] == section:
            out[(r["target"], r.get(key))].append(r)
    return out


def _lat(r: Run, field: str = "latency_us") -> dict[str, float]:
    return r.get(field) or {}


def fixed(runs: list[Run]) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for (target, conns), rs in sorted(_group(runs, "fixed", "conns").items()):
        row: dict[str, Any] = {"rps": _med(r["rps"] for r in rs), "rounds": len(rs)}
        for p in PCTS:
            row[p] = _med(_lat(r).get(p) for r in rs)
        row["cpu_us_per_request"] = _med(r.get("cpu_us_per_request") for r in rs)
        row["upstream_cpu_us_per_request"] = _med(r.get("upstream_cpu_us_per_request") for r in rs)
        row["target_cores"] = _med(r.get("target_cores") for r in rs)
        row["errors"] = sum(r.get("errors_total", 0) for r in rs)
        row["non_2xx"] = sum(r.get("non_2xx", 0) for r in rs)
        out[target][conns] = row
    return dict(out)


def _paired(runs: list[Run], section: str, key: str, value: str, base: str = "direct",
            field: str = "latency_us") -> dict[str, dict[Any, dict[str, Any]]]:
    """Per target and `key`: median over rounds of (target - base) per percentile and of the
    throughput ratio target / base."""
    by = defaultdict(dict)
    for r in runs:
        if r["section"] == section:
            by[(r["target"], r.get(key))][r["round"]] = r
    out: dict[str, dict[Any, dict[str, Any]]] = defaultdict(dict)
    for (target, k), rounds in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        if target == base or (base, k) not in by:
            continue
        pairs = [(rounds[i], by[(base, k)][i]) for i in rounds if i in by[(base, k)]]
        if not pairs:
            continue
        row: dict[str, Any] = {p: _med(_lat(a, field).get(p, 0) - _lat(b, field).get(p, 0)
                                       for a, b in pairs) for p in PCTS}
        row["throughput_ratio"] = _med(a[value] / b[value] for a, b in pairs if b[value])
        out[target][k] = row
    return dict(out)


def overhead(runs: list[Run]) -> dict[str, dict[int, dict[str, Any]]]:
    return _paired(runs, "fixed", "conns", "rps")


def rates(runs: list[Run]) -> dict[str, dict[float, dict[str, Any]]]:
    out: dict[str, dict[float, dict[str, Any]]] = defaultdict(dict)
    for (target, rate), rs in sorted(_group(runs, "rate", "rate").items()):
        row: dict[str, Any] = {"achieved_rps": _med(r["rps"] for r in rs), "rounds": len(rs)}
        for p in PCTS:
            row[p] = _med(_lat(r).get(p) for r in rs)
        row["service_p50"] = _med(_lat(r, "service_us").get("p50") for r in rs)
        row["service_p99"] = _med(_lat(r, "service_us").get("p99") for r in rs)
        row["errors"] = sum(r.get("errors", 0) + r.get("non_2xx", 0) for r in rs)
        out[target][rate] = row
    return dict(out)


def streams(runs: list[Run]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per scenario ("c=1", "c=64", "many=512") and target: TTFB and total time, stalls."""
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    groups: dict[tuple, list[Run]] = defaultdict(list)
    for r in runs:
        if r["section"] in ("stream", "stream-many"):
            scen = f"many={r['conns']}" if r["section"] == "stream-many" else f"c={r['conns']}"
            groups[(scen, r["target"])].append(r)
    for (scen, target), rs in sorted(groups.items()):
        row: dict[str, Any] = {"streams_per_s": _med(r["rps"] for r in rs), "rounds": len(rs),
                               "streams": sum(r["requests"] for r in rs),
                               "stalled": sum(r.get("stalled", 0) for r in rs),
                               "errors": sum(r.get("errors", 0) + r.get("non_2xx", 0) for r in rs)}
        for p in ("p50", "p99"):
            row[f"ttfb_{p}"] = _med(_lat(r, "ttfb_us").get(p) for r in rs)
            row[f"total_{p}"] = _med(_lat(r, "latency_us").get(p) for r in rs)
            row[f"max_gap_{p}"] = _med(_lat(r, "max_gap_us").get(p) for r in rs)
        out[scen][target] = row
    for rows in out.values():
        base = rows.get("direct")
        if base:
            for target, row in rows.items():
                if target != "direct":
                    row["added_ttfb_p50"] = _diff(row["ttfb_p50"], base["ttfb_p50"])
                    row["added_ttfb_p99"] = _diff(row["ttfb_p99"], base["ttfb_p99"])
    return dict(out)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 2)


def arch(runs: list[Run]) -> list[dict[str, Any]]:
    groups: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        if r["section"] == "arch":
            groups[r["config"]].append(r)
    rows = []
    for config, rs in groups.items():
        row: dict[str, Any] = {"config": config, "rps": _med(r["rps"] for r in rs),
                               "rounds": len(rs),
                               "cpu_us_per_request": _med(r.get("cpu_us_per_request") for r in rs),
                               "errors": sum(r.get("errors_total", 0) for r in rs),
                               "max_worker_rss_mib": _mib(max(
                                   (max(r["rss_kib"] or [0]) for r in rs), default=0))}
        for p in PCTS:
            row[p] = _med(_lat(r).get(p) for r in rs)
        rows.append(row)
    default = next((r for r in rows if r["config"] == "default"), None)
    for row in rows:
        if default and default["rps"] and row["rps"] is not None:
            row["rps_vs_default"] = round(row["rps"] / default["rps"], 2)
    return rows


def ceiling(runs: list[Run]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for gen in ("wrk", "loadgen"):
        rs = [r for r in runs if r["section"] == "ceiling" and r.get("generator") == gen]
        if rs:
            out[gen] = {
                "rps": _med(r["rps"] for r in rs), "rounds": len(rs),
                "generator_cores": _med(r["generator_cores"] for r in rs),
                "generator_cpu_us_per_request": _med(
                    r["generator_cpu_s"] / r["requests"] * 1e6 for r in rs if r["requests"]),
                "nginx_cores": _med(r["target_cores"] for r in rs),
            }
    return out


def _mib(kib: float) -> float:
    return round(kib / 1024, 1)


def memory(runs: list[Run], readings: dict[str, Any]) -> dict[str, Any]:
    velox = [max(r["rss_kib"] or [0]) for r in runs if r["target"] == "velox"]
    out: dict[str, Any] = {k: [_mib(v) for v in vals] for k, vals in readings.items()
                           if k.startswith("rss_kib")}
    out = {k.replace("rss_kib", "rss_mib"): v for k, v in out.items()}
    out["max_worker_rss_mib"] = _mib(max(velox, default=0))
    lite = [r["rss_kib"][0] for r in runs if r["target"] == "litellm" and r["rss_kib"]]
    if lite:
        out["litellm_rss_mib"] = _mib(max(lite))
    return out


def load(runs: list[Run], limit: float) -> dict[str, dict[str, Any]]:
    """Cores used by other people's processes during the kept runs, per section."""
    out: dict[str, dict[str, Any]] = {}
    for section in dict.fromkeys(r["section"] for r in runs):
        vals = [r["foreign_cores"] for r in runs if r["section"] == section]
        out[section] = {"median": _med(vals), "max": round(max(vals), 3),
                        "runs": len(vals), "over_limit": sum(v > limit for v in vals),
                        "repeated": sum(r.get("attempt", 1) > 1 for r in runs
                                        if r["section"] == section)}
    return out


def summarize(runs: list[Run], readings: dict[str, Any], soak: dict[str, Any] | None = None,
              foreign_limit: float = 0.15) -> dict[str, Any]:
    out = {"fixed": fixed(runs), "overhead": overhead(runs), "rate": rates(runs),
           "stream": streams(runs), "arch": arch(runs), "ceiling": ceiling(runs),
           "memory": memory(runs, readings), "load": load(runs, foreign_limit)}
    out["goals"] = goals(out, soak)
    return out


def _get(d: Any, *path: Any) -> Any:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key, d.get(str(key)) if not isinstance(key, str) else None)
    return d


def _goal(source: str, text: str, measured: float | None, target: float | None,
          ok: bool | None, unit: str, detail: str = "") -> dict[str, Any]:
    return {"source": source, "goal": text, "measured": measured, "target": target,
            "unit": unit, "reached": ok, "detail": detail}


def goals(s: dict[str, Any], soak: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The targets of the benchmark issue and the gateway issue, each with its verdict."""
    over, fx = s["overhead"], s["fixed"]
    v50, n50 = _get(over, "velox", 1, "p50"), _get(over, "nginx", 1, "p50")
    v99, n99 = _get(over, "velox", 1, "p99"), _get(over, "nginx", 1, "p99")
    v64, n64, l64 = (_get(fx, t, 64, "rps") for t in ("velox", "nginx", "litellm"))
    many_key = next((k for k in s["stream"] if k.startswith("many=")), "many=?")
    many, many_n = s["stream"].get(many_key, {}), many_key.split("=", 1)[1]
    vs = many.get("velox", {})
    rss = s["memory"].get("max_worker_rss_mib")
    growth = (soak or {}).get("growth_mib")
    cpu = _get(fx, "velox", 64, "cpu_us_per_request")

    def cmp(a: float | None, b: float | None, le: bool = True) -> bool | None:
        return None if a is None or b is None else (a <= b if le else a >= b)

    out = [
        _goal("issue 4", "added p50 latency at 1 connection <= 2x nginx's", v50,
              None if n50 is None else round(2 * n50, 1),
              cmp(v50, None if n50 is None else 2 * n50),
              "us", f"nginx adds {n50} us"),
        _goal("issue 4", "added p99 latency at 1 connection <= nginx's + 100 us", v99,
              None if n99 is None else round(n99 + 100, 1),
              cmp(v99, None if n99 is None else n99 + 100), "us", f"nginx adds {n99} us"),
        _goal("issue 4", "requests/s at 64 connections >= 60% of nginx's", v64,
              None if n64 is None else round(0.6 * n64),
              cmp(v64, None if n64 is None else 0.6 * n64, le=False), "req/s",
              f"nginx {n64} req/s"),
        _goal("issue 4", "requests/s at 64 connections >= 200x LiteLLM's", v64,
              None if l64 is None else round(200 * l64),
              cmp(v64, None if l64 is None else 200 * l64, le=False), "req/s",
              f"LiteLLM {l64} req/s"),
        _goal("issue 4", f"streaming adds <= 0.3 ms to time to first byte (p50), {many_n} "
              "concurrent streams", vs.get("added_ttfb_p50"), 300.0,
              cmp(vs.get("added_ttfb_p50"), 300.0), "us",
              f"p99 adds {vs.get('added_ttfb_p99')} us"),
        _goal("issue 4", "no stream stalls with many concurrent streams", vs.get("stalled"), 0,
              None if vs.get("stalled") is None else vs["stalled"] == 0, "streams",
              f"{vs.get('streams')} streams"),
        _goal("issue 4", "<= 40 MiB RSS per worker", rss, 40.0, cmp(rss, 40.0) if rss else None,
              "MiB", "largest worker reading in any run"),
        _goal("issue 4", "RSS flat over ~1M requests (soak)", growth, 1.0,
              None if growth is None else growth <= 1.0, "MiB",
              "growth over the second half of `make bench-soak`" if soak else "soak not run"),
        _goal("issue 3", "Velox adds <= 150 us at p50 with one connection", v50, 150.0,
              cmp(v50, 150.0), "us"),
        _goal("issue 3", ">= 10,000 requests/s at 64 connections with 2 workers", v64, 10000.0,
              cmp(v64, 10000.0, le=False), "req/s"),
        _goal("issue 3", "<= 70 us CPU per proxied request, HTTP/2 + TLS egress", cpu, 70.0,
              cmp(cpu, 70.0), "us", "supervisor + workers, utime + stime, at 64 connections"),
    ]
    return out + native_goals(s)


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is not positive (an added latency that
    measured <= 0 against direct has no meaningful multiple)."""
    return None if a is None or b is None or b <= 0 else round(a / b, 2)


def native_goals(s: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 12's targets: Velox against nginx with a TLS upstream ("nginx-tls": HTTP/1.1 over
    TLS with keep-alive upstream connections, the closest to Velox's HTTP/2 + TLS egress), and
    Velox's HTTP/1.1 cleartext egress (the arch section) against nginx with a cleartext upstream.
    Every figure is a ratio of two medians from the same run."""
    over, fx, tn = s["overhead"], s["fixed"], "nginx-tls"
    out: list[dict[str, Any]] = []

    def add(text: str, a: float | None, b: float | None, limit: float, at_most: bool,
            unit: str, what: str, extra: str = "") -> None:
        r = _ratio(a, b)
        ok = None if r is None else (r <= limit if at_most else r >= limit)
        out.append(_goal("issue 12", text, r, limit, ok, "x",
                         f"Velox {a} {unit}, {what} {b} {unit}{extra}"))

    for conns, limit in ((64, 1.2), (1, 2.0)):
        add(f"CPU per request at {conns} connection{'s' if conns > 1 else ''} <= {limit}x "
            "nginx's with a TLS upstream", _get(fx, "velox", conns, "cpu_us_per_request"),
            _get(fx, tn, conns, "cpu_us_per_request"), limit, True, "us", "nginx-tls")
    clear = next((r for r in s.get("arch", []) if r["config"] == "egress=http1 cleartext"), {})
    add("CPU per request at 64 connections, HTTP/1.1 cleartext egress, <= 2x nginx's with a "
        "cleartext upstream", clear.get("cpu_us_per_request"),
        _get(fx, "nginx", 64, "cpu_us_per_request"), 2.0, True, "us", "nginx",
        " (Velox from the arch section)")
    add("added p50 latency at 1 connection <= 1.5x nginx's with a TLS upstream",
        _get(over, "velox", 1, "p50"), _get(over, tn, 1, "p50"), 1.5, True, "us", "nginx-tls")
    add("requests/s at 64 connections >= 0.9x nginx's with a TLS upstream",
        _get(fx, "velox", 64, "rps"), _get(fx, tn, 64, "rps"), 0.9, False, "req/s", "nginx-tls")
    many_key = next((k for k in s["stream"] if k.startswith("many=")), "many=?")
    many = s["stream"].get(many_key, {})
    v, n = many.get("velox", {}), many.get(tn, {})
    add(f"added time to first byte (p50), {many_key.split('=', 1)[1]} concurrent streams, <= 2x "
        "nginx's with a TLS upstream", v.get("added_ttfb_p50"), n.get("added_ttfb_p50"), 2.0,
        True, "us", "nginx-tls", f"; stalled: Velox {v.get('stalled')}, nginx-tls "
        f"{n.get('stalled')}")
    return out
