"""The console's live numbers: a small ring of samples the admin server takes itself.

One thread in the supervisor reads shared memory every `INTERVAL_S` (the same counters and
histograms /metrics reads; nothing asks the workers) and keeps the last `KEEP` samples, 15
minutes. Each sample is what happened during its interval, per worker and in total:
requests/s, errors/s (5xx) and 4xx/s, p50 and p99 latency of the requests answered in it
(from the difference of the latency histogram's buckets, so a quiet minute is not hidden by a
busy hour), cache hits and lookups, tokens/s; and per upstream its breaker state, in-flight
requests and attempts by outcome class. A change of breaker state between two samples is
kept as a transition (and an opening that came and went between two samples shows in the
upstream's `open_count`).

So an open console page costs the gateway a poll of already-made numbers: `/ui/api/series`
returns the samples after a given time (a page asks for what it lacks), `/ui/api/upstreams`
the upstreams' live state. Workers are shown by logical slot (a reload's new worker of slot i
runs in physical slot i or i + workers: both are worker i).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Any

from velox.core.fields import UPSTREAM_CLASSES, F, H

INTERVAL_S = 1.0
KEEP = 900  # 15 minutes of 1 s samples
TRANSITIONS_KEEP = 200


def window_quantiles(now: dict[int, int], before: dict[int, int],
                     qs: tuple[float, ...]) -> list[int]:
    """Nearest-rank quantiles (bucket upper bounds, µs) of what `now` has more than `before`
    (two cumulative histograms as {upper bound: count}); zeros when nothing was added."""
    added = sorted((upper, count - before.get(upper, 0)) for upper, count in now.items()
                   if count > before.get(upper, 0))
    total = sum(n for _, n in added)
    out = []
    for q in qs:
        if not total:
            out.append(0)
            continue
        rank, seen = max(1, -(-total * q // 1)), 0
        for upper, n in added:
            seen += n
            if seen >= rank:
                out.append(upper)
                break
    return out


class Sampler:
    def __init__(self, shared: Any, clock: Any = time.time) -> None:
        self.shared = shared
        self.clock = clock
        self.samples: deque[dict[str, Any]] = deque(maxlen=KEEP)
        self.transitions: deque[dict[str, Any]] = deque(maxlen=TRANSITIONS_KEEP)
        self.lock = threading.Lock()
        self._prev: dict[str, Any] | None = None
        self._states: dict[str, tuple[str, int]] = {}  # state and open_count
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.cpu_s = 0.0  # this thread's CPU, for the console's cost figure

    def use(self, shared: Any) -> None:
        """After a reload: the new configuration's upstreams (counters carry on)."""
        with self.lock:
            self.shared = shared
            self._prev = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="velox-console", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * INTERVAL_S)

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S - (time.monotonic() % INTERVAL_S)):
            start = time.thread_time()
            try:
                self.take()
            except Exception:
                import logging

                logging.getLogger("velox.admin").exception("console sampler failed")
            self.cpu_s += time.thread_time() - start

    # --- one sample ---------------------------------------------------------------------

    def _read(self) -> dict[str, Any]:
        """The cumulative numbers, per physical slot and per upstream."""
        shared = self.shared
        rows = shared.counters.snapshot()
        hist = shared.histograms[H.TOTAL]
        tokens = [0] * shared.slots
        for block in shared.tokens:
            for slot, row in enumerate(block.snapshot()):
                tokens[slot] += sum(row)
        status = shared.upstream_status.totals()
        width = len(UPSTREAM_CLASSES)
        return {
            "t": self.clock(),
            "rows": rows,
            "buckets": [dict(hist.buckets(slot)) for slot in range(shared.slots)],
            "tokens": tokens,
            "upstreams": {spec.name: status[u * width:(u + 1) * width]
                          for u, spec in enumerate(shared.tables.upstreams)},
        }

    def take(self) -> dict[str, Any] | None:
        with self.lock:
            now = self._read()
            prev, self._prev = self._prev, now
            health = self.shared.health.snapshot()["upstreams"]
            self._note_transitions(now["t"], health)
            if prev is None:
                return None
            sample = self._diff(prev, now, health)
            self.samples.append(sample)
            return sample

    def _note_transitions(self, t: float, health: dict[str, dict[str, Any]]) -> None:
        """A state change since the last sample; an opening that came and went between two
        samples (open_count moved, open_s is short) is kept too, as open and back."""
        for name, row in health.items():
            state, opens = row["state"], row["open_count"]
            before = self._states.get(name)
            if before is not None:
                was, opened = before
                steps = [was]
                if opens > opened and was != "open":
                    steps.append("open")
                if steps[-1] != state:
                    steps.append(state)
                for a, b in itertools.pairwise(steps):
                    self.transitions.append({"t": t, "upstream": name, "from": a, "to": b})
            self._states[name] = (state, opens)

    def _diff(self, prev: dict[str, Any], now: dict[str, Any],
              health: dict[str, dict[str, Any]]) -> dict[str, Any]:
        dt = max(1e-3, now["t"] - prev["t"])
        workers = self.shared.workers
        per: list[dict[str, Any]] = []
        for logical in range(workers):
            slots = (logical, logical + workers)
            per.append(self._numbers(prev, now, slots, dt))
        total = self._numbers(prev, now, tuple(range(self.shared.slots)), dt)
        ups = {}
        for name, counts in now["upstreams"].items():
            before = prev["upstreams"].get(name, [0] * len(counts))
            row = health.get(name, {})
            ups[name] = {"state": row.get("state"), "in_flight": row.get("in_flight", 0),
                         **{c: round((a - b) / dt, 3) for c, a, b in
                            zip(UPSTREAM_CLASSES, counts, before, strict=True)}}
        return {"t": round(now["t"], 3), "total": total, "workers": per, "upstreams": ups}

    @staticmethod
    def _numbers(prev: dict[str, Any], now: dict[str, Any], slots: tuple[int, ...],
                 dt: float) -> dict[str, Any]:
        def delta(field: int) -> int:
            return sum(now["rows"][s][field] - prev["rows"][s][field] for s in slots)

        requests = delta(F.REQUESTS)
        hits = delta(F.CACHE_HITS) + delta(F.CACHE_COALESCED)
        lookups = hits + delta(F.CACHE_MISSES)
        merged_now: dict[int, int] = {}
        merged_before: dict[int, int] = {}
        for s in slots:
            for upper, n in now["buckets"][s].items():
                merged_now[upper] = merged_now.get(upper, 0) + n
            for upper, n in prev["buckets"][s].items():
                merged_before[upper] = merged_before.get(upper, 0) + n
        p50, p99 = window_quantiles(merged_now, merged_before, (0.5, 0.99))
        tokens = sum(now["tokens"][s] - prev["tokens"][s] for s in slots)
        return {
            "rps": round(requests / dt, 3),
            "errors_ps": round(delta(F.RESP_5XX) / dt, 3),
            "client_errors_ps": round(delta(F.RESP_4XX) / dt, 3),
            "error_rate": round(delta(F.RESP_5XX) / requests, 4) if requests else 0.0,
            "p50_us": p50, "p99_us": p99,
            "cache_hit_rate": round(hits / lookups, 4) if lookups else None,
            "tokens_per_min": round(tokens * 60 / dt),
        }

    # --- what the console reads ---------------------------------------------------------

    def since(self, t: float) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.samples if s["t"] > t]
