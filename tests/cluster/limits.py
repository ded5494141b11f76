"""The local buckets the refresher fills: the native Limits, as in the gateway."""

from __future__ import annotations

from velox._native import Limits


def local_limits(n: int) -> Limits:
    return Limits(n)
