"""Hit-rate simulation: one shared LRU for the whole gateway against one LRU per worker.

The seed's cache test, for N workers. A deterministic stream of requests (seeded) in which a
stated share are repeats of an earlier prompt: each request is, with probability `repeat`, a
repeat of a prompt already seen, chosen with Zipf-like popularity (rank r among the prompts
seen so far with probability ~ 1/r: the first prompts are the popular ones), otherwise a new
prompt. Each prompt's answer has a fixed size (log-normal, median ~1.5 KiB, capped at 64 KiB).
The kernel's SO_REUSEPORT spread sends each request to a worker picked uniformly at random.

Designs compared, each with LRU eviction by bytes (value bytes + 72 bytes of entry header):
  shared          one LRU of capacity C for all workers (what velox._native.SharedCache is;
                  its hit rate does not depend on N)
  per-worker C    N LRUs of capacity C each (N times the memory)
  per-worker C/N  N LRUs of capacity C/N each (the same memory as the shared one)
plus the native SharedCache(C) itself replayed on the same stream (block accounting: 512-byte
blocks), to show that the real store matches the model.

Figures: hit rate, upstream calls (misses), upstream calls saved (hits), the memory held at
the end (sum over the caches) and the number of answers held more than once.

Two capacities by default: C = 16 MiB (under pressure: it holds under a tenth of the answers)
and C = 256 MiB (every answer fits: what is left is the cost of missing each prompt once per
worker instead of once per gateway), each at repeat ratios of 50% and 80%.

Run: `.venv/bin/python -m benches.cache_sim [--requests 200000] [--repeat 0.5 ...]
[--capacity-mib 16 ...] [--seed 1]`. Writes benches/results/cache_sim.json and prints one
markdown table per workload.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from velox._native import SharedCache

RESULTS = Path(__file__).parent / "results" / "cache_sim.json"
ENTRY_OVERHEAD = 72  # vx_centry: what an entry costs besides its value, in the model
WORKERS = (1, 2, 4, 8)


class LRU:
    """LRU bounded by bytes (value + ENTRY_OVERHEAD), OrderedDict-based."""

    __slots__ = ("data", "cap", "bytes", "hits", "misses")

    def __init__(self, cap: int) -> None:
        self.data: OrderedDict[int, int] = OrderedDict()
        self.cap = cap
        self.bytes = 0
        self.hits = self.misses = 0

    def access(self, prompt: int, size: int) -> bool:
        """A request for prompt: True on a hit; on a miss the answer is stored."""
        if prompt in self.data:
            self.data.move_to_end(prompt)
            self.hits += 1
            return True
        self.misses += 1
        cost = size + ENTRY_OVERHEAD
        if cost > self.cap:
            return False
        self.data[prompt] = cost
        self.bytes += cost
        while self.bytes > self.cap:
            _, c = self.data.popitem(last=False)
            self.bytes -= c
        return False


def workload(requests: int, repeat: float, seed: int) -> tuple[list[int], list[int]]:
    """(prompt ids of the request stream, answer size of each prompt id)."""
    rnd = random.Random(seed)
    stream: list[int] = []
    sizes: list[int] = []
    for _ in range(requests):
        seen = len(sizes)
        if seen and rnd.random() < repeat:
            # rank = floor(seen ** u) - 1 with u uniform: P(rank < x) = log(x + 1) / log(seen),
            # a density ~ 1/x over the prompts seen so far (Zipf with s = 1).
            stream.append(min(seen - 1, int(seen ** rnd.random()) - 1))
        else:
            sizes.append(min(65536, int(rnd.lognormvariate(math.log(1536), 0.8))))
            stream.append(seen)
    return stream, sizes


def run_lru(stream: list[int], sizes: list[int], workers: int, cap: int, seed: int) -> dict[str,
                                                                                            Any]:
    caches = [LRU(cap) for _ in range(workers)]
    spread = random.Random(seed ^ 0x5EED)
    for p in stream:
        caches[spread.randrange(workers) if workers > 1 else 0].access(p, sizes[p])
    hits = sum(c.hits for c in caches)
    held: dict[int, int] = {}
    for c in caches:
        for p in c.data:
            held[p] = held.get(p, 0) + 1
    return {
        "hits": hits,
        "misses": sum(c.misses for c in caches),
        "memory_held": sum(c.bytes for c in caches),
        "memory_bound": cap * workers,
        "held_more_than_once": sum(1 for n in held.values() if n > 1),
    }


def run_native(stream: list[int], sizes: list[int], cap: int) -> dict[str, Any]:
    cache = SharedCache(cap)
    keys = [hashlib.sha256(b"%d" % p).digest() for p in range(len(sizes))]
    blobs = {n: b"a" * n for n in set(sizes)}
    t = 10**9
    hits = misses = 0
    for p in stream:
        if cache.get(keys[p], t) is not None:
            hits += 1
        else:
            misses += 1
            cache.put(keys[p], blobs[sizes[p]], t, 10**12)
    s = cache.stats()
    assert cache._check() == 0
    return {"hits": hits, "misses": misses, "memory_held": s["bytes"], "memory_bound": cap,
            "mapped": s["mapped"], "held_more_than_once": 0, "evictions": s["evictions"]}


def simulate(requests: int, repeat: float, cap: int, seed: int) -> dict[str, Any]:
    stream, sizes = workload(requests, repeat, seed)
    repeats = requests - len(sizes)
    rows: list[dict[str, Any]] = []

    def add(workers: int, design: str, per_cache: int, r: dict[str, Any]) -> None:
        r.update({"workers": workers, "design": design, "capacity_per_cache": per_cache,
                  "hit_rate": round(r["hits"] / requests, 4),
                  "upstream_calls": r["misses"], "upstream_calls_saved": r["hits"]})
        rows.append(r)

    shared = run_lru(stream, sizes, 1, cap, seed)
    native = run_native(stream, sizes, cap)
    for n in WORKERS:
        add(n, "shared", cap, dict(shared))
        add(n, "shared (native SharedCache)", cap, dict(native))
        if n > 1:
            add(n, "per-worker C", cap, run_lru(stream, sizes, n, cap, seed))
            add(n, "per-worker C/N", cap // n, run_lru(stream, sizes, n, cap // n, seed))
    return {
        "requests": requests,
        "repeat_ratio": repeat,
        "repeats": repeats,
        "unique_prompts": len(sizes),
        "max_hit_rate": round(repeats / requests, 4),
        "unique_bytes": sum(sizes),
        "capacity_bytes": cap,
        "seed": seed,
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [
        f"Workload: {result['requests']:,} requests, repeat ratio {result['repeat_ratio']:.0%} "
        f"({result['repeats']:,} repeats of {result['unique_prompts']:,} prompts, Zipf s=1; "
        f"answers {result['unique_bytes'] / mib:.0f} MiB in all; best possible hit rate "
        f"{result['max_hit_rate']:.1%}), C = {result['capacity_bytes'] / mib:.0f} MiB, "
        f"seed {result['seed']}.",
        "",
        "| workers | design | capacity per cache | hit rate | upstream calls | saved | memory held "
        "| answers held twice or more |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['workers']} | {r['design']} | {r['capacity_per_cache'] / mib:.1f} MiB "
            f"| {r['hit_rate']:.1%} | {r['upstream_calls']:,} | {r['upstream_calls_saved']:,} "
            f"| {r['memory_held'] / mib:.1f} MiB | {r['held_more_than_once']:,} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--repeat", type=float, action="append",
                    help="repeat ratio (may be given several times; default 0.5 and 0.8)")
    ap.add_argument("--capacity-mib", type=float, action="append",
                    help="C in MiB (may be given several times; default 16 and 256)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    caps = [int(c * (1 << 20)) for c in (args.capacity_mib or [16, 256])]
    started = time.time()
    results = [simulate(args.requests, r, cap, args.seed)
               for cap in caps for r in (args.repeat or [0.5, 0.8])]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"generated_by": "benches/cache_sim.py",
                                    "workloads": results}, indent=2) + "\n")
    for r in results:
        print(table(r))
        print()
    print(f"({time.time() - started:.1f} s; written to {args.out})")


if __name__ == "__main__":
    main()
