"""The gateway keys' shared limits: one native `Limits` and the per-key refusal counters.

Made by the supervisor before it forks (`SharedStats` holds it), used by every worker's keys
stage (velox.admission.keys) and read by /stats and /metrics. Key i owns two entries of the
`Limits`: 2i is its request bucket and its gauge of requests in flight, 2i+1 its token bucket;
buckets hold one minute's worth (burst = the limit). A reload keeps the buckets and gauges
when the list of key names is unchanged (the same `Limits`, reconfigured: levels kept, capped
at the new limits); otherwise the new configuration's keys start afresh.

Run-time keys (velox.admin.keystore) take the entries the file's keys leave free: the table is
made for `MAX_KEYS` keys whatever the file holds (8,192 entries, about 1 MiB of shared memory
with 64 worker slots), and `claim(name, rpm, tpm)` is the one place a run-time key gets its
index. Freed indexes are reused oldest first, so a revoked key's in-flight requests have long
released their places before another key inherits them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from velox._native import Counters, Limits
from velox.config.tables import MAX_KEYS, KeySpec
from velox.core.fields import KF, REFUSAL_REASONS

# A key table that grows (run-time keys): segments of SEGMENT_KEYS keys, each its own shared
# Limits (2 entries a key) and refusal Counters (one field a key: 4,096 is a Counters row's
# most), made on a memfd so a worker that forked before the segment existed maps it from
# descriptors sent over its control socket (SCM_RIGHTS). Pages are only paid when touched:
# about 0.25 KiB per key at 2 worker slots, 3.7 KiB at 64 (the gauges' per-slot rows).
SEGMENT_KEYS = 4096
TABLE_MAX_KEYS = 1_000_000
MAX_SEGMENTS = -(-TABLE_MAX_KEYS // SEGMENT_KEYS)  # 245


class KeySegment:
    """One segment's shared state: keys k of it use Limits entries 2k (requests, gauge) and
    2k+1 (tokens), and field k of each KF counter."""

    __slots__ = ("limits", "counters")

    def __init__(self, limits: Limits, counters: tuple[Counters, ...]) -> None:
        self.limits = limits
        self.counters = counters


class KeyTable:
    """Key state in segments that can be added while workers run (the API run-time keys use).

    The supervisor owns the table: `grow()` adds a segment (made on memfds) and `fds(i)` gives
    descriptors of segment i to send to the workers (SCM_RIGHTS, in the order given; the
    caller closes them); a worker passes what it received to `attach(fds)`, which maps the
    next segment. Segments made before the workers fork are inherited and need no
    descriptors. A key's global number k lives in segment k // SEGMENT_KEYS at local index
    k % SEGMENT_KEYS (`locate`); request-path code holds its key's segment and local index,
    so a lookup costs what it cost with one table.
    """

    __slots__ = ("slots", "segments")

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.segments: list[KeySegment] = []

    @property
    def capacity(self) -> int:
        """Keys the segments made so far can hold."""
        return len(self.segments) * SEGMENT_KEYS

    def grow(self) -> int:
        """Add a segment (supervisor side); its number. ValueError past TABLE_MAX_KEYS."""
        if len(self.segments) >= MAX_SEGMENTS:
            raise ValueError(f"the key table holds at most {TABLE_MAX_KEYS:,} keys")
        limits = Limits(2 * SEGMENT_KEYS, slots=self.slots, memfd=True)
        counters = tuple(Counters(self.slots, SEGMENT_KEYS, memfd=True) for _ in KF)
        self.segments.append(KeySegment(limits, counters))
        return len(self.segments) - 1

    def fds(self, segment: int) -> list[int]:
        """New descriptors of segment's mappings (its Limits, then each KF counter), for
        `attach` in another process; the caller closes them once sent."""
        seg = self.segments[segment]
        return [seg.limits.fd(), *(c.fd() for c in seg.counters)]

    def attach(self, fds: list[int]) -> int:
        """Map the next segment from the descriptors `fds` gave (worker side); its number.
        The descriptors stay the caller's (close them after)."""
        if len(fds) != 1 + len(KF):
            raise ValueError(f"a key segment is {1 + len(KF)} descriptors, got {len(fds)}")
        limits = Limits.attach(fds[0])
        if len(limits) != 2 * SEGMENT_KEYS or limits.slots != self.slots:
            raise ValueError(f"descriptor {fds[0]} is not a key segment of {self.slots} slots")
        counters = tuple(Counters.attach(fd, self.slots, SEGMENT_KEYS) for fd in fds[1:])
        self.segments.append(KeySegment(limits, counters))
        return len(self.segments) - 1

    def locate(self, key: int) -> tuple[KeySegment, int]:
        """The segment holding global key number `key`, and the key's index in it."""
        return self.segments[key // SEGMENT_KEYS], key % SEGMENT_KEYS

    def forget_slot(self, slot: int) -> int:
        """A worker of `slot` died: give back the places it held in every segment."""
        return sum(seg.limits.forget_slot(slot) for seg in self.segments)


def rpm_index(key: int) -> int:
    """The Limits entry of key i's request bucket and gauge."""
    return 2 * key


def tpm_index(key: int) -> int:
    """The Limits entry of key i's token bucket."""
    return 2 * key + 1


class SharedKeys:
    """The keys' buckets, gauges and counters, in shared memory; made by the supervisor."""

    __slots__ = ("keys", "slots", "limits", "counters", "runtime", "free")

    def __init__(self, keys: Sequence[KeySpec], slots: int,
                 previous: SharedKeys | None = None) -> None:
        # The configuration refuses more (velox.config.tables); a Counters row holds 4,096 fields.
        assert len(keys) <= MAX_KEYS, len(keys)
        self.keys = tuple(keys)
        self.slots = slots
        same = previous is not None and previous.slots == slots and \
            [k.name for k in previous.keys] == [k.name for k in keys]
        self.limits: Limits
        self.counters: tuple[Counters, ...]
        if same:
            assert previous is not None
            self.limits = previous.limits
            self.counters = previous.counters
        else:
            # Sized for MAX_KEYS whatever the file holds: run-time keys take the rest.
            self.limits = Limits(2 * MAX_KEYS, slots=slots)
            self.counters = tuple(Counters(slots, MAX_KEYS) for _ in KF)
        # Run-time keys' indexes (claim): kept by a reload that keeps the table.
        self.runtime: dict[str, int] = dict(previous.runtime) if same and previous else {}
        taken = set(self.runtime.values())
        self.free = deque(i for i in range(len(self.keys), MAX_KEYS) if i not in taken)
        for i, key in enumerate(self.keys):
            self.set_limits(i, key.rpm, key.tpm)

    def set_limits(self, index: int, rpm: int, tpm: int) -> None:
        """Key `index`'s buckets (0: none). One minute's worth: a key may spend its whole
        minute at once, then the rate."""
        if rpm:
            self.limits.configure(rpm_index(index), rpm, rpm)
        if tpm:
            self.limits.configure(tpm_index(index), tpm, tpm)

    def claim(self, name: str) -> int | None:
        """The table index of run-time key `name` (taken on its first claim; its buckets are
        set by `set_limits`); None when every index is taken. The only use run-time keys make
        of the table's size."""
        index = self.runtime.get(name)
        if index is None:
            if not self.free:
                return None
            index = self.runtime[name] = self.free.popleft()
        return index

    def unclaim(self, name: str) -> None:
        """Run-time key `name` was revoked: its index goes to the back of the free queue."""
        index = self.runtime.pop(name, None)
        if index is not None:
            self.free.append(index)

    def forget_slot(self, slot: int) -> int:
        """A worker of `slot` died: give back the places it held (see Limits.forget_slot)."""
        return self.limits.forget_slot(slot)

    def snapshot(self) -> list[dict[str, Any]]:
        """Per key, for /stats: limits, what is left, in flight, counts."""
        totals = [c.totals() for c in self.counters]
        return [self._row(i, totals) for i in range(len(self.keys))]

    def metrics_rows(self, own: int) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """For /metrics: the rows of the first `own` keys (file order), and the others summed
        (requests, in flight, refusals; None when there are no others). Only those keys are
        read: a scrape with thousands of keys costs the supervisor what `own` keys cost."""
        totals = [c.totals() for c in self.counters]
        own = min(own, len(self.keys))
        rows = [self._row(i, totals) for i in range(own)]
        if own == len(self.keys):
            return rows, None
        limits, rest = self.limits, range(own, len(self.keys))
        other = {
            "keys": len(rest),
            "requests": sum(limits.entered(rpm_index(i)) for i in rest),
            "active": sum(limits.active(rpm_index(i)) for i in rest),
            "refused": {reason: sum(totals[KF.REFUSED_RPM + n][own:len(self.keys)])
                        for n, reason in enumerate(REFUSAL_REASONS)},
        }
        return rows, other

    def _row(self, i: int, totals: list[list[int]]) -> dict[str, Any]:
        key = self.keys[i]
        return {
            "name": key.name,
            "rpm": key.rpm, "tpm": key.tpm, "max_parallel": key.max_parallel,
            "models": list(key.models) if key.models is not None else None,
            **self.usage(i, key.rpm, key.tpm, totals),
        }

    def usage(self, i: int, rpm: int, tpm: int,
              totals: list[list[int]] | None = None) -> dict[str, Any]:
        """Key `i`'s live use: what its buckets have left, in flight, counts."""
        if totals is None:
            totals = [c.totals() for c in self.counters]
        limits = self.limits
        return {
            "remaining_requests": limits.level(rpm_index(i)) if rpm else None,
            "remaining_tokens": limits.level(tpm_index(i)) if tpm else None,
            "tokens_taken": limits.taken(tpm_index(i)) if tpm else 0,
            "active": limits.active(rpm_index(i)),
            "requests": limits.entered(rpm_index(i)),
            "refused": {reason: totals[KF.REFUSED_RPM + n][i]
                        for n, reason in enumerate(REFUSAL_REASONS)},
        }
