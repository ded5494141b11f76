"""The worker's ingress queue: the native lock-free ring (native/vx_ring.c).

Ingress pushes each complete request (`try_push`), the worker's drain pops micro-batches
(`pop_batch`). The bound is the point: a full ring refuses at once (503 overloaded), it never
grows. Made by the worker after it has pinned itself, so its memory is on that core's node.
"""

from __future__ import annotations

from velox._native import Ring

__all__ = ["Ring"]
