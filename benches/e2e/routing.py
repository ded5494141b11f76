"""The routing run (`make bench-routing`, `python -m benches.e2e routing`): what spreading over
several upstreams costs the gateway, and what one failing upstream costs its clients.

Three instances of the bundled mock (HTTP/2 + TLS, one process each, one certificate directory)
and Velox configured through a VELOX_CONFIG file, both gateways with the same number of workers
and otherwise the harness's defaults (`VELOX_RATE_LIMIT_RPM=0`):

* spread: wrk at 64 connections against `velox-1` (one `[[upstream]]`, one route to it) and
  `velox-3` (three `[[upstream]]`s, one weighted route, weights 2:1:1), and `velox-env` (no file:
  VELOX_UPSTREAM_* naming mock a, the set-up of the main end-to-end run, to show the file itself
  costs nothing), all running at once, in an order rotated from round to round. Per run: requests/s,
  latency percentiles, the gateway's CPU per request (its whole process tree, /proc) and the mocks'
  CPU apart. The issue's targets: `velox-3`'s throughput within 5% of `velox-1`'s, and its CPU per
  request within 3 us of it; both are reported as measured, misses included.
* failover: wrk at 64 connections against `velox-3` with all three mocks up, with mock `b`
  answering every request 503 (`POST /_mock/behaviour?status=503`), and with mock `b` killed
  (SIGKILL). Each run has a fresh gateway (so a breaker opened in one run cannot help the
  next), a 1 s warm-up with all mocks up, then the fault, then the measured run at once: the
  breaker opening and the retries of the first failed attempts fall inside the measurement.
  Client-visible errors are wrk's non-2xx answers plus its socket errors (expected: zero).
  `failed_upstream_calls`: chat calls mock `b` received during the measured run (how soon the
  breaker stops sending it traffic; not available when it was killed); `gateway_retries`,
  `failed_upstream_state` and `failed_upstream_by_status_class`: the gateway's admin /stats
  after the run (retries by reason, b's breaker state, b's answers by class).

Both sections use the harness's accounting (`Bench.measure`: CPU from /proc, foreign load,
repeat once if disturbed) and run each round under the shared benchmark lock. wrk shares the
2 cores with the gateway and the mocks, as in every end-to-end run. Results go to
benches/results/routing.json (and .csv); `python -m benches.report` turns them into the README's
routing tables.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from benches.e2e import results, wrk
from benches.e2e.bench import FOREIGN_LIMIT, Bench, Plan
from benches.e2e.machine import bench_lock, children, wait_quiet
from benches.e2e.targets import Service
from benches.e2e.workload import API_KEY, MODEL
from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

NAMES = ("a", "b", "c")
WEIGHTS = {"a": 2, "b": 1, "c": 1}
FAILED = "b"  # the upstream taken down in the failover runs
CONNS = 64
CONDITIONS = ("all-up", "b-503", "b-killed")
GOAL_RPS_RATIO = 0.95  # issue 9: three upstreams within 5% of one upstream's throughput
GOAL_CPU_DELTA_US = 3.0  # ... and within 3 us of its CPU per request


class Mocks(Service):
    """The three mocks as one service: their CPU is the upstream share of every run."""

    name = "mocks"

    def __init__(self, logdir: Path, workers: int) -> None:
        self.logdir = logdir
        self.workers_arg = ["--workers", str(workers)]
        self.certdir = tempfile.mkdtemp(prefix="velox-bench-routing-certs-")
        self.mocks: dict[str, MockUpstream] = {}

    def _new(self, name: str, port: int = 0) -> MockUpstream:
        extra = [*self.workers_arg, *(["--port", str(port)] if port else [])]
        return MockUpstream(tls=True, certdir=self.certdir, name=name, extra_args=extra,
                            log_path=str(self.logdir / f"mock-{name}.log")).start()

    def start(self) -> Mocks:
        for name in NAMES:
            self.mocks[name] = self._new(name)
        self.port = self.mocks[NAMES[0]].port
        return self

    def alive(self, name: str) -> bool:
        proc = self.mocks[name]._proc
        return proc is not None and proc.poll() is None

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash would: no GOAWAY, connections reset."""
        mock = self.mocks[name]
        os.kill(mock.pid, signal.SIGKILL)
        mock.stop()  # reaps it

    def restore(self) -> None:
        """Every mock alive (a killed one restarted on its port), normal answers, counters 0."""
        for name, mock in list(self.mocks.items()):
            if not self.alive(name):
                self.mocks[name] = self._new(name, port=mock.port)
            self.mocks[name].behave()
            self.mocks[name].reset()

    @property
    def roots(self) -> list[int]:
        return [m.pid for name, m in self.mocks.items() if self.alive(name)]

    def stop(self) -> None:
        for mock in self.mocks.values():
            mock.stop()


def config_text(mocks: Mocks, names: tuple[str, ...], connections: int = 0) -> str:
    """`connections` > 0 sets each upstream's pool size (0: the default)."""
    parts = []
    for name in names:
        mock = mocks.mocks[name]
        parts.append("\n".join([
            "[[upstream]]", f'name = "{name}"', f'origin = "{mock.origin}"',
            f'api_key_env = "BENCH_KEY_{name.upper()}"', f'ca_file = "{mock.ca_file}"',
            *([f"connections = {connections}"] if connections else []), ""]))
    targets = ", ".join(f'{{ upstream = "{n}", weight = {WEIGHTS[n]} }}' for n in names)
    parts.append(f'[[route]]\nmodel = "{MODEL}"\ntargets = [{targets}]\n')
    return "\n".join(parts)


class RoutedVelox(Service):
    """`python -m velox` with a VELOX_CONFIG naming `names` as upstreams of one route; with no
    names, the configuration without a file (VELOX_UPSTREAM_* pointing at mock a)."""

    def __init__(self, label: str, mocks: Mocks, names: tuple[str, ...], logdir: Path,
                 workers: int, connections: int = 0) -> None:
        self.name = label
        self.env = {"VELOX_WORKERS": str(workers), "VELOX_RATE_LIMIT_RPM": "0",
                    "VELOX_LOG_LEVEL": "warning"}
        if names:
            config = logdir / f"{label}.toml"
            config.write_text(config_text(mocks, names, connections))
            self.env.update({"VELOX_CONFIG": str(config),
                             **{f"BENCH_KEY_{n.upper()}": API_KEY for n in names}})
        else:
            a = mocks.mocks[NAMES[0]]
            self.env.update({"VELOX_UPSTREAM_ORIGIN": a.origin, "OPENAI_API_KEY": API_KEY,
                             "VELOX_UPSTREAM_CA_FILE": str(a.ca_file)})
        self.proc = GatewayProcess(self.env, log_path=logdir / f"{label}.log")

    def start(self) -> RoutedVelox:
        self.proc.start(timeout=60)
        self.port = self.proc.port
        return self

    @property
    def roots(self) -> list[int]:
        return [self.proc.pid]

    @property
    def workers(self) -> list[int]:
        return children(self.proc.pid)

    def stop(self) -> None:
        self.proc.stop()


SPREAD = ("velox-env", "velox-1", "velox-3")
# The control (--conns-control): one upstream with as many connections per worker as velox-3
# holds over its three, to tell the cost of spreading from the cost of more, emptier connections.
CONTROL = "velox-1-3conns"


def gateway_view(velox: RoutedVelox) -> dict[str, Any]:
    """What the gateway's admin /stats says after a run: retries by reason, the failed
    upstream's breaker and answers by status class (empty if the admin server did not answer)."""
    try:
        status, body = velox.proc.admin_get("/stats", timeout=10)
        doc = json.loads(body) if status == 200 else {}
    except (OSError, ValueError):
        return {}
    row = next((u for u in doc.get("upstreams", []) if u.get("name") == FAILED), {})
    return {"gateway_retries": doc.get("retries"),
            "failed_upstream_state": row.get("state"),
            "failed_upstream_by_status_class": row.get("by_status_class")}


def spread(bench: Bench, r: int) -> None:
    names = [t for t in (*SPREAD, CONTROL) if t in bench.services]
    k = r % len(names)
    for target in names[k:] + names[:k]:
        bench.run_wrk({"section": "routing-spread", "round": r}, target, CONNS)


def failover(bench: Bench, mocks: Mocks, r: int) -> None:
    k = r % len(CONDITIONS)
    for condition in CONDITIONS[k:] + CONDITIONS[:k]:
        mocks.restore()
        label = "velox-failover"
        velox = RoutedVelox(label, mocks, NAMES, bench.logdir, bench.plan.velox_workers)
        bench._add(velox, upstream="mocks")
        try:
            time.sleep(0.5)  # let start-up work finish before measuring
            warmup, bench.plan.warmup_s = bench.plan.warmup_s, 0
            wrk.run(velox.port, CONNS, warmup)  # all up: pools and connections warm
            mocks.mocks[FAILED].reset()  # from here on it counts the calls made during the fault
            if condition == "b-503":
                mocks.mocks[FAILED].behave(status=503)
            elif condition == "b-killed":
                mocks.kill(FAILED)
            try:
                bench.run_wrk({"section": "routing-failover", "round": r,
                               "config": condition}, label, CONNS)
            finally:
                bench.plan.warmup_s = warmup
            record = bench.runs[-1]
            record["failed_upstream_calls"] = (
                mocks.mocks[FAILED].stats()["by_path"].get("/v1/chat/completions", 0)
                if mocks.alive(FAILED) else None)
            record.update(gateway_view(velox))
        finally:
            bench.stop_service(label)
    mocks.restore()


def _med(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [x[key] for x in runs if x.get(key) is not None]
    return round(median(vals), 2) if vals else None


def _lat(runs: list[dict[str, Any]], p: str) -> float | None:
    vals = [x["latency_us"][p] for x in runs if x.get("latency_us")]
    return round(median(vals), 1) if vals else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds, and paired ratios (same round) against the reference."""
    def row(sel: list[dict[str, Any]]) -> dict[str, Any]:
        return {"runs": len(sel), "rps": _med(sel, "rps"),
                "p50": _lat(sel, "p50"), "p99": _lat(sel, "p99"), "p99.9": _lat(sel, "p99.9"),
                "cpu_us_per_request": _med(sel, "cpu_us_per_request"),
                "upstream_cpu_us_per_request": _med(sel, "upstream_cpu_us_per_request"),
                "errors": sum(x.get("errors_total", 0) for x in sel),
                "non_2xx": sum(x.get("non_2xx", 0) for x in sel),
                "requests": sum(x.get("requests", 0) for x in sel),
                "foreign_cores_median": _med(sel, "foreign_cores"),
                "retries": sum(sum((x.get("gateway_retries") or {}).values()) for x in sel),
                "foreign_cores_max": max((x["foreign_cores"] for x in sel), default=None)}

    def paired(sel_key: str, ref: str, other: str) -> dict[str, Any]:
        by_round: dict[int, dict[str, dict[str, Any]]] = {}
        for x in runs:
            if x["section"] == sel_key:
                by_round.setdefault(x["round"], {})[x.get("config") or x["target"]] = x
        ratios, deltas, p99s = [], [], []
        for pair in by_round.values():
            if ref in pair and other in pair:
                a, b = pair[ref], pair[other]
                ratios.append(b["rps"] / a["rps"])
                p99s.append(b["latency_us"]["p99"] - a["latency_us"]["p99"])
                if a.get("cpu_us_per_request") is not None and b.get("cpu_us_per_request"):
                    deltas.append(b["cpu_us_per_request"] - a["cpu_us_per_request"])
        return {"rounds": len(ratios),
                "rps_ratio": round(median(ratios), 3) if ratios else None,
                "rps_ratios": [round(v, 3) for v in ratios],
                "cpu_delta_us": round(median(deltas), 2) if deltas else None,
                "cpu_deltas_us": [round(v, 2) for v in deltas],
                "p99_delta_us": round(median(p99s), 1) if p99s else None}

    spread_runs = [x for x in runs if x["section"] == "routing-spread"]
    fail_runs = [x for x in runs if x["section"] == "routing-failover"]
    out: dict[str, Any] = {
        "spread": {t: row([x for x in spread_runs if x["target"] == t])
                   for t in (*SPREAD, CONTROL) if any(x["target"] == t for x in spread_runs)},
        "failover": {c: row([x for x in fail_runs if x.get("config") == c])
                     for c in CONDITIONS if any(x.get("config") == c for x in fail_runs)},
    }
    goals = []
    if spread_runs:
        p = paired("routing-spread", "velox-1", "velox-3")
        out["spread_vs_one"] = p
        out["file_vs_env"] = paired("routing-spread", "velox-env", "velox-1")
        if any(x["target"] == CONTROL for x in spread_runs):
            out["control_vs_one"] = paired("routing-spread", "velox-1", CONTROL)
            out["spread_vs_control"] = paired("routing-spread", CONTROL, "velox-3")
        goals += [
            {"goal": "3 upstreams: throughput vs 1 upstream", "measured": p["rps_ratio"],
             "target": f">= {GOAL_RPS_RATIO}", "unit": "ratio",
             "reached": None if p["rps_ratio"] is None else p["rps_ratio"] >= GOAL_RPS_RATIO},
            {"goal": "3 upstreams: CPU per request minus 1 upstream's",
             "measured": p["cpu_delta_us"], "target": f"<= {GOAL_CPU_DELTA_US}", "unit": "µs",
             "reached": None if p["cpu_delta_us"] is None
             else p["cpu_delta_us"] <= GOAL_CPU_DELTA_US},
        ]
    if fail_runs:
        out["failover_vs_all_up"] = {c: paired("routing-failover", "all-up", c)
                                     for c in CONDITIONS[1:]}
        for c in CONDITIONS[1:]:
            errs = out["failover"].get(c, {})
            if errs:
                total = errs["errors"]
                goals.append({"goal": f"{c}: client-visible errors", "measured": total,
                              "target": "0", "unit": "requests", "reached": total == 0})
    out["goals"] = goals
    return out


def run(plan: Plan, logdir: Path, outdir: Path = results.RESULTS, name: str = "routing",
        sections: tuple[str, ...] = ("spread", "failover"), control: bool = False
        ) -> dict[str, Any]:
    bench = Bench(plan, logdir)
    mocks = Mocks(logdir, plan.mock_workers)
    t0 = time.monotonic()
    load_start = list(os.getloadavg())
    try:
        bench._add(mocks)
        if "spread" in sections:
            bench._add(RoutedVelox("velox-env", mocks, (), logdir, plan.velox_workers),
                       upstream="mocks")
            if control:
                bench._add(RoutedVelox(CONTROL, mocks, NAMES[:1], logdir, plan.velox_workers,
                                       connections=len(NAMES)), upstream="mocks")
            bench._add(RoutedVelox("velox-1", mocks, NAMES[:1], logdir, plan.velox_workers),
                       upstream="mocks")
            bench._add(RoutedVelox("velox-3", mocks, NAMES, logdir, plan.velox_workers),
                       upstream="mocks")
            for r in range(plan.rounds):
                with bench_lock():
                    foreign = wait_quiet(bench.own_roots())
                    print(f"routing spread round {r + 1}/{plan.rounds} (foreign {foreign})",
                          flush=True)
                    spread(bench, r)
            bench.stop_service("velox-3")
            bench.stop_service("velox-1")
            bench.stop_service("velox-env")
            bench.stop_service(CONTROL)
        if "failover" in sections:
            for r in range(plan.rounds):
                with bench_lock():
                    foreign = wait_quiet(bench.own_roots())
                    print(f"routing failover round {r + 1}/{plan.rounds} (foreign {foreign})",
                          flush=True)
                    failover(bench, mocks, r)
    finally:
        bench.stop()
    summ = summarize(bench.runs)
    bench.notes.append(
        "velox-1 and velox-3 read a VELOX_CONFIG file; velox-1 routes to mock a only, velox-3 "
        "to mocks a, b and c with weights 2:1:1; velox-env has no file (VELOX_UPSTREAM_* naming "
        "mock a). Every gateway has the same number of workers. Each [[upstream]] has the default "
        "pool "
        "(VELOX_EGRESS_POOL_CONNECTIONS connections per worker), so velox-3 holds three times "
        "the upstream connections. The mocks' CPU is charged to the upstream, not the gateway; "
        "with three mocks the upstream side can use more of the 2 cores than with one.")
    placement = (f"Velox: {plan.velox_workers} workers per gateway, pinned one per core (the "
                 "default), supervisor unpinned. Not pinned, placed by the kernel on the same 2 "
                 f"cores: the three mocks ({plan.mock_workers} process each, HTTP/2 + TLS) and wrk "
                 "(1 thread). Everything talks over 127.0.0.1.")
    doc = results.document("velox-routing", plan, bench.runs, summ, bench.notes, {
        "placement": placement, "loadavg_start": load_start,
        "seconds": round(time.monotonic() - t0, 1),
        "weights": WEIGHTS, "failed_upstream": FAILED, "conns": CONNS,
        "foreign_limit": FOREIGN_LIMIT})
    results.write(name, doc, bench.runs, outdir)
    return summ


def resummarize(outdir: Path = results.RESULTS, name: str = "routing") -> dict[str, Any]:
    """Recompute the summary of a saved run from its raw runs (after the summary code changed)."""
    path = outdir / f"{name}.json"
    doc = json.loads(path.read_text())
    doc["summary"] = summarize(doc["runs"])
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc["summary"]


def print_summary(summ: dict[str, Any]) -> None:
    print(json.dumps({k: v for k, v in summ.items() if k != "goals"}, indent=1))
    for g in summ["goals"]:
        verdict = {True: "reached", False: "MISSED", None: "n/a"}[g["reached"]]
        print(f"  [{verdict:>7}] {g['goal']}: {g['measured']} {g['unit']} (target {g['target']})")
