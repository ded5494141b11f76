"""What a full run measures, section by section, round by round.

Every section runs `plan.rounds` rounds; each round measures every target once, in an order
rotated from round to round, so slow drift of the machine (and whoever else is using it) falls
on all targets alike. Each (section, round) block runs under the shared benchmark lock and
starts only once the machine is quiet; a block stays well under five minutes.

* ceiling: wrk and the project's generator against nginx `return 200` (how far they can go);
* fixed:   wrk at fixed connection counts, non-streaming;
* rate:    constant request rates (open loop), non-streaming; rates above 80% of a target's
           measured capacity are skipped, since an open loop past capacity only measures a queue;
* stream:  streamed responses at a few connection counts (time to first byte, total time),
           then `many_streams` long streams at once, counting stalls;
* arch:    Velox restarted with one VELOX_* switch changed at a time, at 64 connections.
"""

from __future__ import annotations

import time
from statistics import median

from benches.e2e.bench import Bench
from benches.e2e.machine import bench_lock, rss_kib, wait_quiet

# One variable changed from the default at a time (the last row changes two, said so in its
# name: HTTP/1.1 egress without TLS, the configuration comparable with nginx's upstream side).
ARCH: dict[str, dict[str, str]] = {
    "default": {},
    "batch_max=1": {"VELOX_BATCH_MAX": "1"},
    "batch_max=8": {"VELOX_BATCH_MAX": "8"},
    "egress=http1": {"VELOX_EGRESS": "http1"},
    "egress=http1 cleartext": {"VELOX_EGRESS": "http1", "_upstream": "mock"},
    # nginx runs with `access_log off`; Velox logs every request by default (a thread formats
    # the lines). This row is Velox on the same terms.
    "access_log=0": {"VELOX_ACCESS_LOG": "0"},
}
ARCH_CONNS = 64


def rotated(items: list[str], r: int) -> list[str]:
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def block(bench: Bench, section: str, r: int) -> float:
    """Wait for a quiet machine; returns the foreign cores seen just before the block."""
    foreign = wait_quiet(bench.own_roots())
    print(f"{section} round {r + 1}/{bench.plan.rounds} (foreign load {foreign} cores)",
          flush=True)
    return foreign


def ceiling(bench: Bench, r: int) -> None:
    meta = {"section": "ceiling", "round": r}
    for gen in rotated(["wrk", "loadgen"], r):
        if gen == "wrk":
            bench.run_wrk(meta, "nginx-static", 64)
        else:
            bench.run_loadgen(meta, "nginx-static", "closed", 64)


def fixed(bench: Bench, r: int) -> None:
    for conns in bench.plan.concurrencies:
        for target in rotated(bench.target_names, r):
            bench.run_wrk({"section": "fixed", "round": r}, target, conns)


def capacity(bench: Bench) -> dict[str, float]:
    """Median requests/s of each target at its largest measured connection count <= 64."""
    out: dict[str, float] = {}
    for target in bench.target_names:
        runs = [x for x in bench.runs if x["section"] == "fixed" and x["target"] == target
                and x["conns"] <= 64]
        if runs:
            top = max(x["conns"] for x in runs)
            out[target] = median(x["rps"] for x in runs if x["conns"] == top)
    return out


def rate(bench: Bench, r: int) -> None:
    caps = capacity(bench)
    for rps in bench.plan.rates:
        for target in rotated(bench.target_names, r):
            cap = caps.get(target)
            if cap is not None and rps > 0.8 * cap:
                note = f"rate {rps}/s skipped for {target}: above 80% of its capacity ({cap:.0f}/s)"
                if note not in bench.notes:
                    bench.notes.append(note)
                continue
            bench.run_loadgen({"section": "rate", "round": r}, target, "rate", 64, rate=rps)


def stream(bench: Bench, r: int) -> None:
    for conns in bench.plan.stream_conns:
        for target in rotated(bench.target_names, r):
            bench.run_loadgen({"section": "stream", "round": r}, target, "stream", conns)
    for target in rotated(bench.target_names, r):
        bench.run_loadgen({"section": "stream-many", "round": r}, target, "stream",
                          bench.plan.many_streams, slow=True)


def arch(bench: Bench, r: int) -> None:
    names = list(bench.plan.arch or ARCH)
    for name in rotated(names, r):
        label = "velox-arch"
        try:
            bench.start_velox(label, ARCH[name])
            time.sleep(0.5)  # let start-up work finish before measuring
            bench.run_wrk({"section": "arch", "round": r, "config": name}, label, ARCH_CONNS)
        finally:
            bench.stop_service(label)


SECTIONS = {"ceiling": ceiling, "fixed": fixed, "rate": rate, "stream": stream, "arch": arch}


def run_all(bench: Bench) -> dict[str, object]:
    """Run the planned sections; returns memory readings of the main Velox's workers."""
    velox = bench.services["velox"]
    memory: dict[str, object] = {"rss_kib_start": [rss_kib(p) for p in velox.workers]}
    timings: dict[str, float] = {}
    for section in bench.plan.sections:
        t0 = time.monotonic()
        for r in range(bench.plan.rounds):
            with bench_lock() as waited:
                block(bench, section, r)
                t_block = time.monotonic()
                SECTIONS[section](bench, r)
                held = time.monotonic() - t_block
            print(f"  ({section} round {r + 1}: waited {waited:.0f}s for the lock, "
                  f"held it {held:.0f}s)", flush=True)
        timings[section] = round(time.monotonic() - t0, 1)
        memory[f"rss_kib_after_{section}"] = [rss_kib(p) for p in velox.workers]
    memory["rss_kib_end"] = [rss_kib(p) for p in velox.workers]
    memory["section_seconds"] = timings
    return memory
