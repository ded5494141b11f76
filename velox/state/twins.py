"""Pure-Python reference twins of the native shared counters and latency histograms.

`Counters` and `Histogram` (native/vx_stats.c) live in shared memory so every worker adds to
one table; these twins hold the same numbers in plain lists of one process. They state what the
C does in a few lines each, and the differential tests (tests/native/test_stats_twins.py) drive
both with the same generated operations and compare every read. They are references, not
replacements: a per-process list cannot be shared by the workers, so VELOX_NATIVE=0 keeps the
native tables for these two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MAX_SLOTS = 4096  # slots and fields: at most this many (vx_stats.h: VX_STATS_MAX_SLOTS)
_INT64 = (-(1 << 63), (1 << 63) - 1)
_MAX_PAIRS = 16  # add_many takes 1 to 16 (field, n) pairs

# The histogram's buckets (vx_stats.h): one per value below EXACT, then 64 sub-buckets per
# power of two; values above MAX_US (10 min) count in MAX_US's bucket.
SUB_BITS = 6
SUB = 1 << SUB_BITS
EXACT = 2 * SUB
MAX_US = 600_000_000
BUCKETS = EXACT + (29 - 7) * SUB + 7 + 1


def _wrap(value: int) -> int:
    """int64 two's-complement wrap-around, as the C's atomic adds do."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def _check_int64(value: int) -> None:
    if not _INT64[0] <= value <= _INT64[1]:
        raise ValueError(f"{value} does not fit in int64")


class PyCounters:
    """slots x fields int64 counters (the native Counters' API without memfd)."""

    def __init__(self, slots: int, fields: int) -> None:
        if not (1 <= slots <= MAX_SLOTS and 1 <= fields <= MAX_SLOTS):
            raise ValueError(f"slots and fields must be in [1, {MAX_SLOTS}]")
        self.slots = slots
        self.fields = fields
        self._rows = [[0] * fields for _ in range(slots)]

    def _check(self, slot: int, field: int) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range")
        if not 0 <= field < self.fields:
            raise IndexError(f"field {field} out of range")

    def add(self, slot: int, field: int, n: int = 1, /) -> None:
        self._check(slot, field)
        _check_int64(n)
        row = self._rows[slot]
        row[field] = _wrap(row[field] + n)

    def add_many(self, slot: int, *field_n: int) -> None:
        """Every pair checked before anything is added, as the native call does."""
        if not field_n or len(field_n) % 2 or len(field_n) > 2 * _MAX_PAIRS:
            raise TypeError(f"add_many takes 1 to {_MAX_PAIRS} (field, n) pairs")
        pairs = list(zip(field_n[::2], field_n[1::2], strict=True))
        for field, n in pairs:
            self._check(slot, field)
            _check_int64(n)
        for field, n in pairs:
            self.add(slot, field, n)

    def set(self, slot: int, field: int, value: int, /) -> None:
        self._check(slot, field)
        _check_int64(value)
        self._rows[slot][field] = value

    def get(self, slot: int, field: int, /) -> int:
        self._check(slot, field)
        return self._rows[slot][field]

    def totals(self) -> list[int]:
        return [_wrap(sum(column)) for column in zip(*self._rows, strict=True)]

    def snapshot(self) -> list[list[int]]:
        return [list(row) for row in self._rows]


def bucket_index(value_us: int) -> int:
    """vx_hist_index: the bucket of a value (clamped to [0, MAX_US])."""
    value = min(max(value_us, 0), MAX_US)
    if value < EXACT:
        return value
    k = value.bit_length() - 1  # 7 .. 29
    return EXACT + (k - 7) * SUB + (value >> (k - SUB_BITS)) - SUB


def bucket_lower(index: int) -> int:
    if index < EXACT:
        return index
    group, sub = divmod(index - EXACT, SUB)
    return (SUB + sub) << (group + 1)


def bucket_upper(index: int) -> int:
    """Inclusive."""
    if index < EXACT:
        return index
    return bucket_lower(index) + (1 << ((index - EXACT) // SUB + 1)) - 1


def bucket_mid(index: int) -> int:
    low, high = bucket_lower(index), bucket_upper(index)
    return low + (high - low) // 2


class PyHistogram:
    """One log-linear latency histogram per slot (the native Histogram's API)."""

    def __init__(self, slots: int) -> None:
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in [1, {MAX_SLOTS}]")
        self.slots = slots
        self._counts = [[0] * BUCKETS for _ in range(slots)]
        self._sums = [0] * slots

    def _slot(self, slot: int) -> None:
        if not -1 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range")

    def record(self, slot: int, value_us: int, /) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range")
        if not _INT64[0] <= value_us <= _INT64[1]:
            raise ValueError(f"value_us {value_us} does not fit in int64")
        value = max(value_us, 0)
        self._counts[slot][bucket_index(value)] += 1
        self._sums[slot] = _wrap(self._sums[slot] + value)

    def _merged(self, slot: int) -> list[int]:
        self._slot(slot)
        rows = self._counts if slot < 0 else [self._counts[slot]]
        return [sum(column) for column in zip(*rows, strict=True)]

    def percentiles(self, qs: Sequence[float], slot: int = -1) -> list[int]:
        """Nearest rank: the midpoint of the first bucket holding ceil(q * count) values."""
        self._slot(slot)  # the slot is checked first, as the native call does
        for q in qs:
            if not 0 < q <= 1:
                raise ValueError(f"quantile must be in (0, 1], got {q!r}")
        counts = self._merged(slot)
        total = sum(counts)
        out = []
        for q in qs:
            if total <= 0:
                out.append(0)
                continue
            rank = max(1, math.ceil(q * total))  # in doubles, as the C computes it
            seen = 0
            for index, n in enumerate(counts):
                seen += n
                if seen >= rank:
                    out.append(bucket_mid(index))
                    break
        return out

    def count(self, slot: int = -1) -> int:
        return sum(self._merged(slot))

    def total_us(self, slot: int = -1) -> int:
        self._slot(slot)
        return _wrap(sum(self._sums) if slot < 0 else self._sums[slot])

    def buckets(self, slot: int = -1) -> list[tuple[int, int]]:
        return [(bucket_upper(i), n) for i, n in enumerate(self._merged(slot)) if n]
