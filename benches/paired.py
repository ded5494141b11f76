"""Variants of one workload timed against each other in one run, on the thread's CPU clock.

Rounds of the variants are interleaved in a rotating order and each is timed with
time.thread_time_ns (time this thread ran: other processes on a busy machine do not count), so
drifts of a shared host move every variant alike; the median round is reported.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any


def paired_cpu_us(benchmark: Any, group: str, runs: Mapping[str, Callable[[], None]],
                  rounds: int, items_per_round: int,
                  after: Mapping[str, Callable[[], None]] | None = None) -> dict[str, float]:
    """CPU microseconds per item of each variant (the median round over `items_per_round`).
    `after[name]`, when given, runs after each of that variant's rounds, untimed (work of
    its own it must not leave to the next variant's round: another thread's, say)."""
    names = list(runs)
    samples: dict[str, list[int]] = {name: [] for name in names}

    def run() -> None:
        clock = time.thread_time_ns
        for r in range(rounds):
            for k in range(len(names)):
                name = names[(r + k) % len(names)]
                one = runs[name]
                t0 = clock()
                one()
                samples[name].append(clock() - t0)
                if after is not None and name in after:
                    after[name]()

    gc.collect()
    gc.freeze()
    try:
        benchmark.group = group
        benchmark.pedantic(run, rounds=1, iterations=1)
    finally:
        gc.unfreeze()
    return {name: statistics.median(v) / items_per_round / 1000 for name, v in samples.items()}
