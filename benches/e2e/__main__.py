"""Command line: `python -m benches.e2e {run,routing,cache,batching,soak,cluster,install-litellm,
lock-litellm}` (run from the repository root with the project's venv; the Makefile targets do
exactly that).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benches.e2e import (
    batching,
    cache,
    cluster,
    litellm,
    results,
    routing,
    sections,
    soak,
    summary,
    wrk,
)
from benches.e2e import bench as bench_mod
from benches.e2e.bench import Bench, Plan

QUICK = {"rounds": 1, "duration_s": 2, "warmup_s": 1, "concurrencies": (1, 64), "rates": (1000,),
             "stream_conns": (1,), "many_streams": 64, "arch": ("default", "egress=http1")}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def cmd_run(args: argparse.Namespace) -> int:
    if not wrk.available():
        print("wrk is not installed (make bench-e2e installs it with apt-get)", file=sys.stderr)
        return 2
    plan = Plan(**QUICK) if args.quick else Plan()
    if args.rounds:
        plan.rounds = args.rounds
    if args.duration:
        plan.duration_s = args.duration
    if args.sections:
        plan.sections = tuple(args.sections.split(","))
    if args.concurrencies:
        plan.concurrencies = _ints(args.concurrencies)
    if args.arch:
        plan.arch = tuple(args.arch.split(";"))
    plan.litellm = not args.no_litellm
    logdir = Path(tempfile.mkdtemp(prefix="velox-bench-logs-"))
    print(f"logs in {logdir}", flush=True)
    bench = Bench(plan, logdir)
    load_start = list(os.getloadavg())
    t0 = time.monotonic()
    try:
        bench.start()
        readings = sections.run_all(bench)
    finally:
        bench.stop()
    soak_doc = _load_soak(args.out)
    summ = summary.summarize(bench.runs, readings, soak_doc, bench_mod.FOREIGN_LIMIT)
    doc = results.document("velox-e2e", plan, bench.runs, summ, bench.notes, {
        "loadavg_start": load_start, "seconds": round(time.monotonic() - t0, 1),
        "memory_readings": readings})
    js, cs = results.write(args.name, doc, bench.runs, args.out)
    print(f"wrote {js} and {cs} in {doc['seconds']:.0f}s")
    for g in summ["goals"]:
        verdict = {True: "reached", False: "MISSED", None: "n/a"}[g["reached"]]
        print(f"  [{verdict:>7}] {g['source']}: {g['goal']}: {g['measured']} {g['unit']} "
              f"(target {g['target']}) {g['detail']}")
    return 0


def _load_soak(outdir: Path) -> dict | None:
    import json

    path = outdir / "soak.json"
    if path.exists():
        return json.loads(path.read_text()).get("summary")
    return None


def cmd_soak(args: argparse.Namespace) -> int:
    logdir = Path(tempfile.mkdtemp(prefix="velox-bench-soak-"))
    analysis = soak.run(args.requests, logdir, args.out)
    print(analysis)
    return 0


def cmd_routing(args: argparse.Namespace) -> int:
    if args.resummarize:
        routing.print_summary(routing.resummarize(args.out, args.name))
        return 0
    if not wrk.available():
        print("wrk is not installed (make bench-deps installs it with apt-get)", file=sys.stderr)
        return 2
    plan = Plan(rounds=args.rounds, duration_s=args.duration, litellm=False, sections=())
    logdir = Path(tempfile.mkdtemp(prefix="velox-bench-routing-"))
    print(f"logs in {logdir}", flush=True)
    summ = routing.run(plan, logdir, args.out, args.name, tuple(args.sections.split(",")),
                       control=args.conns_control)
    routing.print_summary(summ)
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    if not wrk.available():
        print("wrk is not installed (make bench-deps installs it with apt-get)", file=sys.stderr)
        return 2
    plan = Plan(rounds=args.rounds, duration_s=args.duration, litellm=False, sections=())
    logdir = Path(tempfile.mkdtemp(prefix="velox-bench-cache-"))
    print(f"logs in {logdir}", flush=True)
    summ = cache.run(plan, logdir, args.out, args.name, tuple(args.sections.split(",")))
    cache.print_summary(summ)
    return 0


def cmd_batching(args: argparse.Namespace) -> int:
    if not wrk.available():
        print("wrk is not installed (make bench-deps installs it with apt-get)", file=sys.stderr)
        return 2
    doc = batching.run(rounds=args.rounds, duration_s=args.duration, outdir=args.out,
                       name=args.name)
    batching.print_summary(doc)
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    doc = cluster.main(args.out, args.name, quick=args.quick)
    for part in ("shared", "keyed", "single_host_no_redis"):
        d = doc[part]
        print(f"{part}: admitted {d['admitted']} of {d['sent']} sent, bounds "
              f"[{d['lower']}, {d['upper']}] (stated {d['stated_bound']}), within={d['within']}, "
              f"server errors {d['server_errors']}, recovered {d['recovered_s']}")
    print("commands:", doc["shared"].get("commands"))
    print(f"wrote {args.out / (args.name + '.json')}")
    return 0 if all(doc[p]["within"] and not doc[p]["server_errors"]
                    for p in ("shared", "keyed", "single_host_no_redis")) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benches.e2e")
    p.add_argument("--out", type=Path, default=results.RESULTS, help="results directory")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the end-to-end comparison (about 20 minutes)")
    run.add_argument("--quick", action="store_true", help="one short round of each (a smoke test)")
    run.add_argument("--rounds", type=int)
    run.add_argument("--duration", type=int, help="measured seconds per run")
    run.add_argument("--sections", help="comma-separated subset of " + ",".join(sections.SECTIONS))
    run.add_argument("--concurrencies", help="e.g. 1,16,64,256")
    run.add_argument("--arch", help="semicolon-separated subset of: " + "; ".join(sections.ARCH))
    run.add_argument("--no-litellm", action="store_true")
    run.add_argument("--name", default="e2e", help="results file name (without extension)")
    rt = sub.add_parser("routing", help="three upstreams against one, and failover (~4 minutes)")
    rt.add_argument("--rounds", type=int, default=5)
    rt.add_argument("--duration", type=int, default=5, help="measured seconds per run")
    rt.add_argument("--sections", default="spread,failover", help="spread,failover or one")
    rt.add_argument("--name", default="routing", help="results file name (without extension)")
    rt.add_argument("--conns-control", action="store_true",
                    help="add velox-1-3conns: one upstream, 3 connections per worker")
    rt.add_argument("--resummarize", action="store_true",
                    help="recompute the summary of the saved results from their raw runs")
    ca = sub.add_parser("cache", help="cache hit path against a miss, and a repeat workload")
    ca.add_argument("--rounds", type=int, default=3)
    ca.add_argument("--duration", type=int, default=5, help="measured seconds per run")
    ca.add_argument("--sections", default="hit-path,repeat,lookup")
    ca.add_argument("--name", default="cache", help="results file name (without extension)")
    bt = sub.add_parser("batching", help="embeddings batching on and off (~2 minutes)")
    bt.add_argument("--rounds", type=int, default=2)
    bt.add_argument("--duration", type=int, default=5, help="measured seconds per run")
    bt.add_argument("--name", default="batching", help="results file name (without extension)")
    s = sub.add_parser("soak", help="about a million requests through Velox, RSS sampled")
    s.add_argument("--requests", type=int, default=1_000_000)
    cl = sub.add_parser("cluster",
                        help="three hosts sharing one Redis, 3x a 600 rpm limit for 60 s "
                                        "with Redis killed for 20 s (~3 minutes)")
    cl.add_argument("--quick", action="store_true", help="20 s with an 8 s outage")
    cl.add_argument("--name", default="cluster", help="results file name (without extension)")
    sub.add_parser("install-litellm", help="build .bench/litellm-venv from the hashed lock")
    sub.add_parser("lock-litellm", help="re-resolve the hashed lock (needs the index)")
    args = p.parse_args(argv)
    if args.command == "run":
        return cmd_run(args)
    if args.command == "routing":
        return cmd_routing(args)
    if args.command == "cache":
        return cmd_cache(args)
    if args.command == "batching":
        return cmd_batching(args)
    if args.command == "soak":
        return cmd_soak(args)
    if args.command == "cluster":
        return cmd_cluster(args)
    if args.command == "install-litellm":
        litellm.install()
        return 0
    litellm.lock()
    return 0


if __name__ == "__main__":
    sys.exit(main())
