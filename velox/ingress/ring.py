"""The worker's ingress queue: the native lock-free ring, or asyncio.Queue for comparison.

Both expose the ring's surface (`try_push`, `pop_batch`, `len`, `capacity`), so the worker is
written once and `VELOX_QUEUE=ring|asyncio` swaps the data structure without touching it. The
bound is the point either way: a full queue refuses at once (503), it never grows.
"""

from __future__ import annotations

import asyncio

from velox._native import Ring


class AsyncioQueue:
    """asyncio.Queue behind the ring's interface (put_nowait/get_nowait, bounded)."""

    __slots__ = ("_queue", "capacity")

    def __init__(self, capacity: int) -> None:
        self._queue: asyncio.Queue[object] = asyncio.Queue(maxsize=capacity)
        self.capacity = capacity

    def try_push(self, item: object) -> bool:
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            return False
        return True

    def pop_batch(self, max_n: int = 64) -> list[object]:
        if max_n <= 0:
            raise ValueError(f"max_n must be positive, got {max_n}")
        queue = self._queue
        out = []
        while len(out) < max_n and not queue.empty():
            out.append(queue.get_nowait())
        return out

    def __len__(self) -> int:
        return self._queue.qsize()


def make_queue(kind: str, capacity: int) -> Ring | AsyncioQueue:
    """Build the queue named by VELOX_QUEUE; call it after the worker has pinned itself."""
    if kind == "ring":
        return Ring(capacity)
    if kind == "asyncio":
        return AsyncioQueue(capacity)
    raise ValueError(f"unknown queue kind {kind!r}; expected 'ring' or 'asyncio'")
