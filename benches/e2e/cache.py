"""The cache run (`make bench-cache`, `python -m benches.e2e cache`): what a cache hit costs and
saves against a proxied miss, and what a workload with repeats gains.

* hit-path: wrk at 1 and 64 connections, every request the same chat body, against
  - `direct`: the mock upstream alone (cleartext HTTP/1.1: what "the upstream" takes);
  - `velox-nocache`: Velox without the cache (every request proxied: the miss baseline);
  - `velox-cache` (config `hit`): Velox with VELOX_CACHE=1; after the first request every
    answer is a hit, written by the worker without dispatch;
  - `velox-cache` (config `miss-stored`): the same gateway with `Cache-Control: no-cache` on
    every request: the miss path with the cache's own work on it (key, recording, storing).
  All in one run, interleaved and in an order rotated from round to round. Per run:
  requests/s, latency percentiles, the gateway's CPU per request (its process tree, /proc).
  The paired figures: hit against no-cache miss (CPU per request and p50 latency).
* repeat: the seed's cache test. `REQUESTS` chat requests over `CLIENTS` connections, each a
  repeat of an earlier prompt with probability `REPEAT_RATIO` (seeded), through a fresh
  Velox with the cache on: its hit rate (/stats) and the upstream calls saved (the mock's
  request count). Beside it, the seed's design as a model: a per-worker LRU of 1,000 entries
  fed the same sequence, each request landing on the worker its connection was spread to
  (connections assigned to workers at random, as SO_REUSEPORT's hash does), against one
  shared LRU of the same size: hit rates simulated, not measured.
* lookup: what one hit's lookup costs in a worker: `SharedCache.get` (lock, copy out of the
  shared mapping) against a per-worker `OrderedDict` LRU (the seed's), same entry, in-process.

Results go to benches/results/cache.json (and .csv); `python -m benches.report` turns them into
the README's cache tables.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import OrderedDict
from pathlib import Path
from statistics import median
from typing import Any

import httpx

from benches.e2e import results, workload, wrk
from benches.e2e.bench import FOREIGN_LIMIT, Bench, Plan
from benches.e2e.machine import bench_lock, wait_quiet
from benches.e2e.targets import Mock

CONNS = (1, 64)
CONFIGS = (("direct", "direct", None), ("velox-nocache", "miss", None),
           ("velox-cache", "hit", None), ("velox-cache", "miss-stored",
                                          {"Cache-Control": "no-cache"}))
REQUESTS = 2000
CLIENTS = 16
REPEAT_RATIO = 0.8
SEED_LRU_ENTRIES = 1000  # the seed's per-node cache size


def hit_path(bench: Bench, r: int) -> None:
    plan = bench.plan
    for conns in CONNS:
        k = (r + conns) % len(CONFIGS)
        for target, config, headers in CONFIGS[k:] + CONFIGS[:k]:
            port = bench.port(target)
            if plan.warmup_s:
                wrk.run(port, conns, plan.warmup_s, headers=headers)

            def call(port: int = port, headers: Any = headers) -> dict[str, Any]:
                return {"generator": "wrk",
                        **wrk.run(port, conns, plan.duration_s, headers=headers)}

            bench.measure({"section": "cache-hit-path", "round": r, "conns": conns,
                           "config": config}, target, call)


# --- the repeat workload ---------------------------------------------------------------------


def sequence(n: int, ratio: float, seed: int = 7) -> list[int]:
    """Prompt numbers: each a repeat of a uniformly chosen earlier prompt with probability
    `ratio`, else a new one."""
    rng = random.Random(seed)
    out: list[int] = []
    distinct = 0
    for _ in range(n):
        if distinct and rng.random() < ratio:
            out.append(rng.randrange(distinct))
        else:
            out.append(distinct)
            distinct += 1
    return out


def simulate_lru(seq: list[int], workers: int, entries: int, clients: int,
                 seed: int = 11) -> float:
    """Hit rate of `workers` LRUs of `entries` each (one shared when workers == 1), request i
    sent on connection i % clients, each connection on a random worker."""
    rng = random.Random(seed)
    owner = [rng.randrange(workers) for _ in range(clients)]
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(workers)]
    hits = 0
    for i, prompt in enumerate(seq):
        lru = caches[owner[i % clients]]
        if prompt in lru:
            hits += 1
            lru.move_to_end(prompt)
        else:
            lru[prompt] = None
            if len(lru) > entries:
                lru.popitem(last=False)
    return hits / len(seq)


async def _send(port: int, seq: list[int], clients: int) -> list[str]:
    verdicts: list[str] = []
    queue = list(enumerate(seq))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=60,
                                 headers={"authorization": f"Bearer {workload.API_KEY}"}) as http:
        async def client() -> None:
            while queue:
                _, prompt = queue.pop(0)
                body = {"model": workload.MODEL, "max_tokens": 64, "messages": [
                    {"role": "user", "content": f"Question number {prompt}: what is a cache?"}]}
                response = await http.post(workload.PATH, json=body)
                verdicts.append(response.headers.get("x-velox-cache", "?")
                                if response.status_code == 200 else str(response.status_code))

        await asyncio.gather(*(client() for _ in range(clients)))
    return verdicts


def repeat(bench: Bench, mock: Mock) -> dict[str, Any]:
    velox = bench.start_velox("velox-repeat", {"VELOX_CACHE": "1"})
    try:
        seq = sequence(REQUESTS, REPEAT_RATIO)
        before = mock.mock.stats()["by_path"].get(workload.PATH, 0)
        t0 = time.monotonic()
        verdicts = asyncio.run(_send(velox.port, seq, CLIENTS))
        seconds = time.monotonic() - t0
        calls = mock.mock.stats()["by_path"].get(workload.PATH, 0) - before
        status, body = velox.proc.admin_get("/stats", timeout=10)
        cache = json.loads(body)["cache"] if status == 200 else {}
    finally:
        bench.stop_service("velox-repeat")
    distinct = len(set(seq))
    workers = bench.plan.velox_workers
    return {
        "requests": len(seq), "clients": CLIENTS, "repeat_ratio": REPEAT_RATIO,
        "distinct_prompts": distinct, "seconds": round(seconds, 2),
        "answered_200": sum(v in ("hit", "miss") for v in verdicts),
        "hits": cache.get("hits"), "coalesced": cache.get("coalesced"),
        "misses": cache.get("misses"), "hit_rate": cache.get("hit_rate"),
        "upstream_calls": calls, "upstream_calls_saved": len(seq) - calls,
        "best_possible_hit_rate": round(1 - distinct / len(seq), 4),
        "simulated": {
            "shared_lru_hit_rate": round(simulate_lru(seq, 1, SEED_LRU_ENTRIES, CLIENTS), 4),
            "per_worker_lru_hit_rate": round(
                simulate_lru(seq, workers, SEED_LRU_ENTRIES, CLIENTS), 4),
            "per_worker_lru_upstream_calls": round(
                len(seq) * (1 - simulate_lru(seq, workers, SEED_LRU_ENTRIES, CLIENTS))),
            "workers": workers, "lru_entries": SEED_LRU_ENTRIES},
    }


# --- the lookup itself -----------------------------------------------------------------------


def lookup_cost(iterations: int = 200_000) -> dict[str, Any]:
    """ns per hit lookup of one ~1.3 KB stored answer: the shared store against a dict LRU."""
    from velox._native import SharedCache
    from velox.cache.store import cache_key, encode_entry
    from velox.core.clock import now_ms

    value = encode_entry(False, [(b"content-type", b"application/json")], b"x" * 1300)
    key = cache_key(workload.PATH.encode(), workload.MODEL, b"", False, workload.body())
    store = SharedCache(64 << 20)
    now = now_ms()
    store.put(key, value, now, 3_600_000)
    lru: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict({key: (value, now)})
    shared_get = store.get
    out: dict[str, Any] = {"value_bytes": len(value), "iterations": iterations}
    for name, one in (
            ("shared_store_ns", lambda: shared_get(key, now)),
            ("per_worker_dict_lru_ns", lambda: (lru.get(key), lru.move_to_end(key)))):
        best = []
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(iterations):
                one()
            best.append((time.perf_counter_ns() - t0) / iterations)
        out[name] = round(min(best), 1)
    return out


# --- summary -----------------------------------------------------------------------------------


def _med(xs: list[float]) -> float | None:
    return round(median(xs), 2) if xs else None


def summarize(runs: list[dict[str, Any]], repeat_doc: dict[str, Any] | None,
              lookup: dict[str, Any] | None) -> dict[str, Any]:
    hit_runs = [x for x in runs if x["section"] == "cache-hit-path"]
    rows: dict[str, dict[str, Any]] = {}
    for conns in CONNS:
        for _, config, _ in CONFIGS:
            sel = [x for x in hit_runs if x["conns"] == conns and x["config"] == config]
            if not sel:
                continue
            rows[f"{config}@{conns}"] = {
                "config": config, "conns": conns, "runs": len(sel),
                "rps": _med([x["rps"] for x in sel]),
                "p50": _med([x["latency_us"]["p50"] for x in sel]),
                "p99": _med([x["latency_us"]["p99"] for x in sel]),
                "cpu_us_per_request": _med([x["cpu_us_per_request"] for x in sel
                                            if x.get("cpu_us_per_request") is not None]),
                "errors": sum(x.get("errors_total", 0) for x in sel),
                "foreign_cores": _med([x["foreign_cores"] for x in sel])}
    paired: dict[str, Any] = {}
    for conns in CONNS:
        by_round: dict[int, dict[str, dict[str, Any]]] = {}
        for x in hit_runs:
            if x["conns"] == conns:
                by_round.setdefault(x["round"], {})[x["config"]] = x
        cpu, p50, rps = [], [], []
        for pair in by_round.values():
            if "hit" in pair and "miss" in pair:
                a, b = pair["miss"], pair["hit"]
                if a.get("cpu_us_per_request") and b.get("cpu_us_per_request"):
                    cpu.append(b["cpu_us_per_request"] / a["cpu_us_per_request"])
                p50.append(b["latency_us"]["p50"] - a["latency_us"]["p50"])
                rps.append(b["rps"] / a["rps"])
        paired[str(conns)] = {"rounds": len(rps), "hit_cpu_ratio": _med(cpu),
                              "hit_p50_delta_us": _med(p50), "hit_rps_ratio": _med(rps)}
    goals = []
    for conns in CONNS:
        hit, miss = rows.get(f"hit@{conns}"), rows.get(f"miss@{conns}")
        direct = rows.get(f"direct@{conns}")
        if hit and miss and hit["cpu_us_per_request"] and miss["cpu_us_per_request"]:
            goals.append({"goal": f"{conns} conn(s): hit CPU per request below a proxied miss's",
                          "measured": hit["cpu_us_per_request"], "unit": "µs",
                          "target": f"< {miss['cpu_us_per_request']}",
                          "reached": hit["cpu_us_per_request"] < miss["cpu_us_per_request"]})
        if hit and direct:
            goals.append({"goal": f"{conns} conn(s): hit p50 below the upstream's own p50",
                          "measured": hit["p50"], "unit": "µs", "target": f"< {direct['p50']}",
                          "reached": hit["p50"] is not None and direct["p50"] is not None
                          and hit["p50"] < direct["p50"]})
    return {"hit_path": rows, "paired": paired, "repeat": repeat_doc, "lookup": lookup,
            "goals": goals}


def run(plan: Plan, logdir: Path, outdir: Path = results.RESULTS, name: str = "cache",
        sections: tuple[str, ...] = ("hit-path", "repeat", "lookup")) -> dict[str, Any]:
    bench = Bench(plan, logdir)
    t0 = time.monotonic()
    load_start = list(os.getloadavg())
    repeat_doc = lookup = None
    try:
        plain = bench._add(Mock(tls=False, workers=plan.mock_workers, logdir=logdir))
        bench.services["direct"] = plain
        tls = bench._add(Mock(tls=True, workers=plan.mock_workers, logdir=logdir))
        if "hit-path" in sections:
            bench.start_velox("velox-nocache", {})
            bench.start_velox("velox-cache", {"VELOX_CACHE": "1"})
            for r in range(plan.rounds):
                with bench_lock():
                    foreign = wait_quiet(bench.own_roots())
                    print(f"cache hit-path round {r + 1}/{plan.rounds} (foreign {foreign})",
                          flush=True)
                    hit_path(bench, r)
            bench.stop_service("velox-cache")
            bench.stop_service("velox-nocache")
        if "repeat" in sections:
            with bench_lock():
                print("cache repeat workload", flush=True)
                repeat_doc = repeat(bench, tls)
        if "lookup" in sections:
            lookup = lookup_cost()
    finally:
        bench.stop()
    summ = summarize(bench.runs, repeat_doc, lookup)
    bench.notes.append(
        "velox-nocache and velox-cache differ only in VELOX_CACHE; both send to the same "
        "HTTP/2 + TLS mock. `direct` is wrk against the cleartext mock itself. CPU per request "
        "is the gateway's whole process tree (supervisor and workers) over wrk's requests.")
    placement = (f"Velox: {plan.velox_workers} workers per gateway, pinned one per core (the "
                 "default). Not pinned, on the same 2 cores: the mocks "
                 f"({plan.mock_workers} process each) and wrk (1 thread). All over 127.0.0.1.")
    doc = results.document("velox-cache", plan, bench.runs, summ, bench.notes, {
        "placement": placement, "loadavg_start": load_start,
        "seconds": round(time.monotonic() - t0, 1), "foreign_limit": FOREIGN_LIMIT})
    results.write(name, doc, bench.runs, outdir)
    return summ


def print_summary(summ: dict[str, Any]) -> None:
    print(json.dumps({k: v for k, v in summ.items() if k != "goals"}, indent=1))
    for g in summ["goals"]:
        verdict = {True: "reached", False: "MISSED", None: "n/a"}[g["reached"]]
        print(f"  [{verdict:>7}] {g['goal']}: {g['measured']} {g['unit']} (target {g['target']})")
