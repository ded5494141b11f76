"""Pure-Python reference twin of the shared response cache store (native/vx_cache.c).

`PyCache` restates what the store does with its entries and in-flight markers: an exact LRU
over every entry, accounted in 512-byte blocks (the first carries the 72-byte entry header, so
it holds 440 value bytes), evicting from the least recently used end until a value fits; TTLs
(an entry past its own is removed when read, one older than a reader's max_age left alone);
markers leased to their owner process, taken over once expired or once their owner is gone,
swept when the table is full, and "lead without a marker" past that. The memory layout (how
many blocks and marker slots a capacity gives, and the largest value) is the C's own business:
the twin is given those three numbers (the native store's stats) and tests/native/
test_cache_twins.py compares every answer and counter over generated operations. A reference,
not a switch: one process's dict cannot be the cache every worker shares.
"""

from __future__ import annotations

import os
from collections import OrderedDict

BLOCK = 512
HEAD_DATA = BLOCK - 72  # the entry header's 72 bytes share the first block
KEY = 32
MAX_MS = 1 << 50
_COUNTERS = ("evictions", "expired", "hits", "misses", "stale", "stores", "replaced", "rejected",
             "claims", "takeovers", "markers_full")


def blocks_for(size: int) -> int:
    return 1 if size <= HEAD_DATA else 1 + -(-(size - HEAD_DATA) // BLOCK)


def _key(key: bytes | bytearray | memoryview) -> bytes:
    raw = bytes(key)
    if len(raw) != KEY:
        raise ValueError(f"key must be {KEY} bytes (a SHA-256 digest), got {len(raw)}")
    return raw


def _ms(value: int, name: str, lo: int) -> int:
    if not lo <= value <= MAX_MS:
        raise ValueError(f"{name} must be an integer in [{lo}, {MAX_MS}], got {value!r}")
    return value


def _alive(owner: int) -> bool:
    """The owner process exists (kill(pid, 0), as the C asks; EPERM counts as alive)."""
    if owner <= 0:
        return True
    try:
        os.kill(owner, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Entry:
    __slots__ = ("value", "created", "expires", "blocks")

    def __init__(self, value: bytes, created: int, expires: int) -> None:
        self.value = value
        self.created = created
        self.expires = expires
        self.blocks = blocks_for(len(value))


class _Marker:
    __slots__ = ("owner", "expires", "waiters")

    def __init__(self, owner: int, expires: int) -> None:
        self.owner = owner
        self.expires = expires
        self.waiters = 0

    def live(self, now_ms: int) -> bool:
        return now_ms < self.expires and _alive(self.owner)


class PyCache:
    """The native SharedCache's API (entries and markers) over the geometry it is given."""

    def __init__(self, blocks: int, max_value: int, marker_slots: int) -> None:
        self.blocks = blocks
        self.max_value = max_value
        self.marker_slots = marker_slots
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # first: least recent
        self._markers: dict[bytes, _Marker] = {}
        self._used = 0  # blocks held by entries
        self._value_bytes = 0
        self._n = dict.fromkeys(_COUNTERS, 0)

    def _remove(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self._used -= entry.blocks
        self._value_bytes -= len(entry.value)

    def get(self, key: bytes, now_ms: int, max_age_ms: int | None = -1) -> tuple[bytes, int] | None:
        key = _key(key)
        now = _ms(now_ms, "now_ms", 0)
        max_age = -1 if max_age_ms is None else _ms(max_age_ms, "max_age_ms", -1)
        entry = self._entries.get(key)
        n = self._n
        if entry is None:
            n["misses"] += 1
            return None
        if now >= entry.expires:  # past its own TTL: removed
            self._remove(key)
            n["expired"] += 1
            n["misses"] += 1
            return None
        age = max(now - entry.created, 0)
        if max_age >= 0 and age > max_age:  # too old for this reader: left alone
            n["stale"] += 1
            n["misses"] += 1
            return None
        self._entries.move_to_end(key)
        n["hits"] += 1
        return entry.value, age

    def put(self, key: bytes, value: bytes, now_ms: int, ttl_ms: int) -> bool:
        key = _key(key)
        now = _ms(now_ms, "now_ms", 0)
        ttl = _ms(ttl_ms, "ttl_ms", 1)
        data = bytes(value)
        n = self._n
        if len(data) > self.max_value:
            n["rejected"] += 1
            return False
        if key in self._entries:
            self._remove(key)
            n["replaced"] += 1
        entry = _Entry(data, now, now + ttl)
        while self.blocks - self._used < entry.blocks:  # least recently used out first
            self._remove(next(iter(self._entries)))
            n["evictions"] += 1
        self._entries[key] = entry
        self._used += entry.blocks
        self._value_bytes += len(data)
        n["stores"] += 1
        return True

    def delete(self, key: bytes, /) -> bool:
        key = _key(key)
        if key not in self._entries:
            return False
        self._remove(key)
        return True

    def clear(self) -> None:
        self._entries.clear()
        self._markers.clear()
        self._used = self._value_bytes = 0

    def _slot_free(self, now_ms: int) -> bool:
        """A marker slot is free, after sweeping the expired ones when the table is full."""
        if len(self._markers) < self.marker_slots:
            return True
        for key in [k for k, m in self._markers.items() if now_ms >= m.expires]:
            del self._markers[key]
        return len(self._markers) < self.marker_slots

    def claim(self, key: bytes, now_ms: int, hold_ms: int) -> bool:
        key = _key(key)
        now = _ms(now_ms, "now_ms", 0)
        hold = _ms(hold_ms, "hold_ms", 1)
        n = self._n
        n["claims"] += 1
        marker = self._markers.get(key)
        if marker is not None:
            if marker.live(now):
                marker.waiters = min(marker.waiters + 1, (1 << 31) - 1)
                return False
            marker.owner, marker.expires = os.getpid(), now + hold  # taken over, waiters kept
            n["takeovers"] += 1
            return True
        if not self._slot_free(now):
            n["markers_full"] += 1  # leads without a marker: no coalescing for this key
            return True
        self._markers[key] = _Marker(os.getpid(), now + hold)
        return True

    def renew(self, key: bytes, now_ms: int, hold_ms: int) -> bool:
        key = _key(key)
        now = _ms(now_ms, "now_ms", 0)
        hold = _ms(hold_ms, "hold_ms", 1)
        marker = self._markers.get(key)
        if marker is None or marker.owner != os.getpid():
            return False
        marker.expires = now + hold
        return True

    def unwait(self, key: bytes, /) -> None:
        marker = self._markers.get(_key(key))
        if marker is not None and marker.waiters > 0:
            marker.waiters -= 1

    def waiting(self, key: bytes, /) -> int:
        marker = self._markers.get(_key(key))
        return 0 if marker is None else marker.waiters

    def release(self, key: bytes, /) -> bool:
        key = _key(key)
        marker = self._markers.get(key)
        if marker is None or marker.owner != os.getpid():
            return False
        del self._markers[key]
        return True

    def pending(self, key: bytes, now_ms: int) -> bool:
        key = _key(key)
        marker = self._markers.get(key)
        return marker is not None and marker.live(_ms(now_ms, "now_ms", 0))

    def stats(self) -> dict[str, int]:
        """The behaviour's part of the native stats (the geometry's is what it was given)."""
        return {"entries": len(self._entries), "bytes": self._used * BLOCK,
                "value_bytes": self._value_bytes, "markers": len(self._markers), **self._n}
