"""The report's plots (matplotlib, PNG), drawn from the saved result documents only.

`draw(results_dir, e2e, micro, soak)` writes whichever plots its inputs allow and returns their
file names; `python -m benches.report` embeds them in report.html and the README.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {"direct": "#555555", "velox": "#d62728", "nginx": "#2ca02c", "nginx-tls": "#98df8a",
          "litellm": "#1f77b4"}
ORDER = ("direct", "velox", "nginx", "nginx-tls", "litellm")
PCTS = ("p50", "p90", "p99", "p99.9")
NINES = (0.5, 0.9, 0.99, 0.999)


def _targets(d: dict[str, Any]) -> list[str]:
    return [t for t in ORDER if t in d] + sorted(t for t in d if t not in ORDER)


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _nines_axis(ax: Any) -> None:
    import math

    ax.set_xticks([-math.log10(1 - q) for q in NINES], [p.upper() for p in PCTS])
    ax.set_xlabel("percentile")


def latency_percentiles(out: Path, s: dict[str, Any]) -> str:
    import math

    conns = sorted({int(c) for t in s["fixed"].values() for c in t})
    fig, axes = plt.subplots(1, len(conns), figsize=(4 * len(conns), 3.6), squeeze=False)
    for ax, c in zip(axes[0], conns, strict=False):
        for t in _targets(s["fixed"]):
            row = s["fixed"][t].get(str(c)) or s["fixed"][t].get(c)
            if row:
                ax.plot([-math.log10(1 - q) for q in NINES], [row[p] for p in PCTS], "o-",
                        color=COLORS.get(t), label=t)
        ax.set_yscale("log")
        ax.set_title(f"{c} connection{'s' if c > 1 else ''}")
        ax.set_ylabel("latency µs")
        _nines_axis(ax)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return _save(fig, out / "latency_percentiles.png")


def throughput(out: Path, s: dict[str, Any]) -> str:
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for t in _targets(s["fixed"]):
        pts = sorted((int(c), r["rps"]) for c, r in s["fixed"][t].items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=COLORS.get(t), label=t)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("connections")
    ax.set_ylabel("requests/s")
    ax.set_title("Throughput against concurrency (non-streaming)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, out / "throughput.png")


def overhead(out: Path, s: dict[str, Any]) -> str:
    over = s["overhead"]
    conns = sorted({int(c) for t in over.values() for c in t})
    fig, axes = plt.subplots(1, len(conns), figsize=(4 * len(conns), 3.6), squeeze=False)
    targets = _targets(over)
    width = 0.8 / max(1, len(targets))
    for ax, c in zip(axes[0], conns, strict=False):
        for i, t in enumerate(targets):
            row = over[t].get(str(c)) or over[t].get(c) or {}
            ax.bar([j + i * width for j in range(len(PCTS))], [row.get(p) or 0 for p in PCTS],
                   width, color=COLORS.get(t), label=t)
        ax.set_xticks([j + width * (len(targets) - 1) / 2 for j in range(len(PCTS))],
                      [p.upper() for p in PCTS])
        ax.set_yscale("symlog", linthresh=100)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_title(f"added latency vs direct, {c} conn.")
        ax.set_ylabel("µs (symlog)")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=8)
    return _save(fig, out / "overhead.png")


def rate(out: Path, s: dict[str, Any]) -> str:
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for t in _targets(s["rate"]):
        pts = sorted((float(k), r) for k, r in s["rate"][t].items())
        xs = [p[0] for p in pts]
        ax.plot(xs, [p[1]["p50"] for p in pts], "o-", color=COLORS.get(t), label=f"{t} p50")
        ax.plot(xs, [p[1]["p99"] for p in pts], "s--", color=COLORS.get(t), label=f"{t} p99")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered requests/s (constant rate)")
    ax.set_ylabel("latency µs (from due time)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out / "rate.png")


def streaming(out: Path, s: dict[str, Any]) -> str:
    scens = sorted(s["stream"], key=lambda k: (k.startswith("many"), int(k.split("=")[1])))
    fig, axes = plt.subplots(1, len(scens), figsize=(4 * len(scens), 3.6), squeeze=False)
    for ax, scen in zip(axes[0], scens, strict=False):
        rows = s["stream"][scen]
        ts = _targets(rows)
        ax.bar(range(len(ts)), [rows[t]["ttfb_p50"] or 0 for t in ts],
               color=[COLORS.get(t) for t in ts], label="p50")
        ax.scatter(range(len(ts)), [rows[t]["ttfb_p99"] or 0 for t in ts], color="black",
                   marker="_", s=300, label="p99", zorder=3)
        ax.set_xticks(range(len(ts)), ts)
        ax.set_yscale("log")
        n = scen.split("=")[1]
        ax.set_title(f"time to first byte, {n} {'long streams' if 'many' in scen else 'conn.'}")
        ax.set_ylabel("µs")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=8)
    return _save(fig, out / "streaming.png")


def architecture(out: Path, s: dict[str, Any]) -> str:
    rows = s["arch"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 0.35 * len(rows) + 1.5), sharey=True)
    names = [r["config"] for r in rows]
    colors = ["#d62728" if n == "default" else "#999999" for n in names]
    a1.barh(names, [r["rps"] or 0 for r in rows], color=colors)
    a1.set_xlabel("requests/s at 64 connections")
    a2.barh(names, [r["p99"] or 0 for r in rows], color=colors)
    a2.set_xscale("log")
    a2.set_xlabel("p99 latency µs")
    a1.invert_yaxis()
    for ax in (a1, a2):
        ax.grid(alpha=0.3, axis="x")
    return _save(fig, out / "architecture.png")


def micro_ratios(out: Path, micro: dict[str, Any]) -> str | None:
    bars = []
    for b in micro["benchmarks"]:
        for key, value in b["extra_info"].items():
            if not isinstance(value, (int, float)) or not value:
                continue
            if key.startswith(("ratio_vs_", "cpu_ratio_vs_")):
                bars.append((f"{b['name']} vs {key.split('_vs_', 1)[1]}"
                             + (" (CPU)" if key.startswith("cpu_") else ""), value))
            elif key.startswith("ratio_to_") and f"[{key[9:]}]" not in b["name"]:
                bars.append((f"{b['name']} vs {key[9:]}", 1 / value))
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(bars) + 1.2))
    ax.barh([b[0] for b in bars], [b[1] for b in bars],
            color=["#2ca02c" if b[1] >= 1 else "#d62728" for b in bars])
    ax.axvline(1, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("speed-up (> 1: the project's component is faster)")
    ax.tick_params(axis="y", labelsize=7)
    ax.invert_yaxis()
    ax.grid(alpha=0.3, axis="x", which="both")
    return _save(fig, out / "micro_ratios.png")


def soak_plot(out: Path, soak: dict[str, Any]) -> str | None:
    samples = soak.get("samples") or []
    if not samples:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.4))
    workers = len(samples[0]["rss_mib"])
    xs = [s["requests"] / 1e6 for s in samples]
    for w in range(workers):
        ax.plot(xs, [s["rss_mib"][w] for s in samples], "o-", ms=3, label=f"worker {w} RSS")
        if all(s.get("pss_mib") for s in samples):
            ax.plot(xs, [s["pss_mib"][w] for s in samples], "s--", ms=2,
                    label=f"worker {w} PSS")
    ax.set_xlabel("requests served (millions)")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "soak.png")


def draw(out: Path, e2e: dict[str, Any] | None, micro: dict[str, Any] | None,
         soak: dict[str, Any] | None) -> set[str]:
    made: list[str | None] = []
    if e2e:
        s = e2e["summary"]
        if s.get("fixed"):
            made += [latency_percentiles(out, s), throughput(out, s)]
        if s.get("overhead"):
            made.append(overhead(out, s))
        if s.get("rate"):
            made.append(rate(out, s))
        if s.get("stream"):
            made.append(streaming(out, s))
        if s.get("arch"):
            made.append(architecture(out, s))
    if micro:
        made.append(micro_ratios(out, micro))
    if soak:
        made.append(soak_plot(out, soak))
    return {m for m in made if m}


def cluster_plot(out: Path, doc: dict[str, Any]) -> str | None:
    """Admitted requests per second, per host and in total, against the shared limit line;
    the Redis outage shaded (benches/e2e/cluster.py's results)."""
    runs = [(part, doc[part]) for part in ("shared", "keyed") if doc.get(part)]
    if not runs:
        return None
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 4 * len(runs)), squeeze=False)
    for (part, run), ax in zip(runs, axes[:, 0], strict=False):
        _cluster_panel(ax, run, "VELOX_RATE_LIMIT_RPM" if part == "shared" else "one [[key]]")
    return _save(fig, out / "cluster.png")


def _cluster_panel(ax: Any, shared: dict[str, Any], what: str) -> None:
    per = shared["per_second"]
    plan = shared["plan"]
    xs = list(range(len(per["total"])))
    if plan.get("outage"):
        ev = shared.get("events", {})
        start = ev.get("killed", plan["outage"][0])
        end = ev.get("restarted", plan["outage"][1])
        ax.axvspan(start, end, color="#f2c9c9", label="Redis killed (SIGKILL) until restarted")
    for i, row in enumerate(per["hosts"]):
        ax.step(xs, row, where="post", lw=1, alpha=0.8, label=f"host {i + 1}")
    ax.step(xs, per["total"], where="post", lw=2.2, color="black", label="all hosts")
    limit = shared["limit_per_s"]
    ax.axhline(limit, color="#d62728", ls="--", lw=1.5,
               label=f"limit ({plan['rpm']} rpm = {limit:g}/s)")
    ax.axhline(limit / plan["hosts"], color="#d62728", ls=":", lw=1,
               label="one host's share")
    ax.set_xlabel("second of the run (requests by send time)")
    ax.set_ylabel("requests admitted per second")
    ax.set_title(f"{plan['hosts']} Velox hosts, one Redis, {what} (burst {plan['burst']}), "
                 f"load {plan['factor']:g}x the limit", fontsize=10)
    ax.set_xlim(0, len(xs))
    ax.set_ylim(0, max(*per["total"], limit) * 1.3)
    ax.legend(fontsize=7, loc="upper right", ncol=3)
