"""The local buckets the refresher fills: the native Limits (a stand-in until it exists)."""

from __future__ import annotations

import threading
import time
from typing import Any


class _StandIn:
    """Pure-Python Limits with the same rules (leased when rate 0), for development only."""

    def __init__(self, n: int) -> None:
        self.lock = threading.Lock()
        self.cfg = [(0, 0)] * n
        self.lvl = [0.0] * n
        self.tk = [0] * n
        self.last = [0.0] * n

    def _refill(self, i: int) -> None:
        rate, burst = self.cfg[i]
        now = time.monotonic()
        if rate:
            self.lvl[i] = min(burst, self.lvl[i] + (now - self.last[i]) * rate / 60)
        self.last[i] = now

    def configure(self, i: int, rate: int, burst: int) -> None:
        with self.lock:
            first = self.cfg[i] == (0, 0)
            self._refill(i)
            self.cfg[i] = (rate, burst)
            if first:
                self.lvl[i] = burst if rate else 0
            self.lvl[i] = min(self.lvl[i], burst)

    def take(self, i: int, n: int) -> int:
        with self.lock:
            self._refill(i)
            if self.lvl[i] >= n:
                self.lvl[i] -= n
                self.tk[i] += n
                return 0
            return 1_000_000

    def give(self, i: int, n: int) -> int:
        with self.lock:
            before = self.lvl[i]
            self.lvl[i] = min(self.cfg[i][1], self.lvl[i] + n)
            return int(self.lvl[i] - before)

    def level(self, i: int) -> int:
        with self.lock:
            self._refill(i)
            return int(self.lvl[i])

    def taken(self, i: int) -> int:
        return self.tk[i]


def local_limits(n: int) -> Any:
    try:
        from velox._native import Limits  # type: ignore[attr-defined]
    except ImportError:
        return _StandIn(n)
    return Limits(n)
