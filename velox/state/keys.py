"""The gateway keys' shared limits: a growing key table and the per-key refusal counters.

Made by the supervisor before it forks (`SharedStats` holds it), used by every worker's keys
stage (velox.admission.keys) and read by /stats and /metrics. Key i lives in segment
i // 4,096 of a `KeyTable` at local index k = i % 4,096: that segment's `Limits` entry 2k is
its request bucket and its gauge of requests in flight, 2k+1 its token bucket, field k of each
KF counter its refusals; buckets hold one minute's worth (burst = the limit). A reload keeps
the table (buckets and gauges) when the list of key names is unchanged (levels kept, capped at
the new limits); otherwise the new configuration's keys start afresh.

The file's keys take the first indexes; run-time keys (velox.admin.keystore) the rest, claimed
through `claim(name)`, the one place a run-time key gets its index. The table starts with the
segments the file needs (at least one) and grows by a segment when run-time keys fill it, up
to 1,000,000 keys in all (`MAX_KEYS`); a grown segment reaches the running workers as memfd
descriptors (velox.admin.keyfeed). Freed indexes are reused oldest first, so a revoked key's
in-flight requests have long released their places before another key inherits them.
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
TABLE_MAX_KEYS = MAX_KEYS  # file keys and run-time keys together (velox.config.tables)
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
    """The keys' buckets, gauges and counters, in shared memory; made by the supervisor.

    Key i (the file's keys first, in file order, then run-time keys as claimed) lives in the
    growing `KeyTable`: made with the segments the file's keys need (at least one, so the
    first 4,096 keys in all need no hand-over), grown by `claim` when run-time keys fill it.
    A grown segment reaches running workers as descriptors (velox.admin.keyfeed)."""

    __slots__ = ("keys", "slots", "table", "runtime", "free", "limits_of")

    def __init__(self, keys: Sequence[KeySpec], slots: int,
                 previous: SharedKeys | None = None) -> None:
        # The configuration refuses more (velox.config.tables names file, table and key).
        assert len(keys) <= TABLE_MAX_KEYS, len(keys)
        self.keys = tuple(keys)
        self.slots = slots
        same = previous is not None and previous.slots == slots and \
            [k.name for k in previous.keys] == [k.name for k in keys]
        if same:
            # One table for both generations of a reload, and one claim book: a run-time key
            # claimed for either has the same index in both.
            assert previous is not None
            self.table: KeyTable = previous.table
            self.runtime: dict[str, int] = previous.runtime
            self.free: deque[int] = previous.free
            self.limits_of: dict[int, tuple[int, int]] = previous.limits_of
        else:
            self.table = KeyTable(slots)
            self.table.grow()
            while self.table.capacity < len(self.keys):
                self.table.grow()
            self.runtime = {}
            self.free = deque(range(len(self.keys), self.table.capacity))
            self.limits_of = {}  # index → (rpm, tpm) as last set (supervisor side)
        for i, key in enumerate(self.keys):
            self.set_limits(i, key.rpm, key.tpm)

    @property
    def segments(self) -> int:
        return len(self.table.segments)

    @property
    def limits(self) -> Limits:
        """The first segment's Limits: keys 0..4,095 (the file's first keys)."""
        return self.table.segments[0].limits

    @property
    def counters(self) -> tuple[Counters, ...]:
        """The first segment's refusal counters, by KF field (keys 0..4,095)."""
        return self.table.segments[0].counters

    def entry(self, index: int) -> tuple[Limits, int, int]:
        """Key `index`'s Limits and its request and token entries in it."""
        seg, k = self.table.locate(index)
        return seg.limits, rpm_index(k), tpm_index(k)

    def set_limits(self, index: int, rpm: int, tpm: int) -> None:
        """Key `index`'s buckets (0: none). One minute's worth: a key may spend its whole
        minute at once, then the rate."""
        limits, rpm_i, tpm_i = self.entry(index)
        self.limits_of[index] = (rpm, tpm)
        if rpm:
            limits.configure(rpm_i, rpm, rpm)
        if tpm:
            limits.configure(tpm_i, tpm, tpm)

    def claim(self, name: str) -> int | None:
        """The table index of run-time key `name` (taken on its first claim; its buckets are
        set by `set_limits`); a full table grows by a segment (the caller sends it to the
        running workers before any frame naming its indexes); None at TABLE_MAX_KEYS."""
        index = self.runtime.get(name)
        if index is None:
            if not self.free:
                try:
                    segment = self.table.grow()
                except ValueError:
                    return None
                self.free.extend(range(segment * SEGMENT_KEYS, (segment + 1) * SEGMENT_KEYS))
            index = self.runtime[name] = self.free.popleft()
        return index

    def unclaim(self, name: str) -> None:
        """Run-time key `name` was revoked: its index goes to the back of the free queue."""
        index = self.runtime.pop(name, None)
        if index is not None:
            self.limits_of.pop(index, None)
            self.free.append(index)

    def forget_slot(self, slot: int) -> int:
        """A worker of `slot` died: give back the places it held (see Limits.forget_slot)."""
        return int(self.table.forget_slot(slot))

    def _refused(self, index: int, totals: dict[int, list[list[int]]]) -> list[int]:
        """Key `index`'s counts by KF field, from per-segment totals made once a read."""
        segment, k = divmod(index, SEGMENT_KEYS)
        rows = totals.get(segment)
        if rows is None:
            rows = totals[segment] = [c.totals() for c in self.table.segments[segment].counters]
        return [row[k] for row in rows]

    def snapshot(self) -> list[dict[str, Any]]:
        """Per key, for /stats: limits, what is left, in flight, counts."""
        totals: dict[int, list[list[int]]] = {}
        return [self._row(i, totals) for i in range(len(self.keys))]

    def runtime_snapshot(self) -> list[dict[str, Any]]:
        """Per run-time key, for /stats: its limits (rpm, tpm) and live use."""
        totals: dict[int, list[list[int]]] = {}
        return [self._runtime_row(name, index, totals) for name, index in self._claimed()]

    def _claimed(self) -> list[tuple[str, int]]:
        """The run-time keys (name, index), in the order they were claimed."""
        return sorted(self.runtime.items(), key=lambda item: item[1])

    def _runtime_row(self, name: str, index: int,
                     totals: dict[int, list[list[int]]]) -> dict[str, Any]:
        rpm, tpm = self.limits_of.get(index, (0, 0))
        return {"name": name, "rpm": rpm, "tpm": tpm, **self.usage(index, rpm, tpm, totals)}

    def metrics_rows(self, own: int) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """For /metrics: the rows of the first `own` keys (the file's in order, then run-time
        keys as claimed), and the others summed (requests, in flight, refusals, tokens; None
        when there are no others). Only those keys are read: a scrape with thousands of keys
        costs the supervisor what `own` keys cost."""
        totals: dict[int, list[list[int]]] = {}
        file_keys = len(self.keys)
        claimed = self._claimed()
        rows = [self._row(i, totals) for i in range(min(own, file_keys))]
        rows += [self._runtime_row(name, index, totals)
                 for name, index in claimed[:max(0, own - file_keys)]]
        rest = [*range(own, file_keys), *(index for _, index in claimed[max(0, own - file_keys):])]
        if not rest:
            return rows, None
        requests = active = 0
        counts = [0] * len(KF)
        for i in rest:
            limits, rpm_i, _ = self.entry(i)
            requests += limits.entered(rpm_i)
            active += limits.active(rpm_i)
            for n, count in enumerate(self._refused(i, totals)):
                counts[n] += count
        other = {"keys": len(rest), "requests": requests, "active": active,
                 "refused": dict(zip(REFUSAL_REASONS, counts, strict=False)),
                 "tokens_in": counts[KF.TOKENS_IN], "tokens_out": counts[KF.TOKENS_OUT]}
        return rows, other

    def _row(self, i: int, totals: dict[int, list[list[int]]]) -> dict[str, Any]:
        key = self.keys[i]
        return {
            "name": key.name,
            "rpm": key.rpm, "tpm": key.tpm, "max_parallel": key.max_parallel,
            "models": list(key.models) if key.models is not None else None,
            **self.usage(i, key.rpm, key.tpm, totals),
        }

    def usage(self, i: int, rpm: int, tpm: int,
              totals: dict[int, list[list[int]]] | None = None) -> dict[str, Any]:
        """Key `i`'s live use: what its buckets have left, in flight, counts."""
        limits, rpm_i, tpm_i = self.entry(i)
        counts = self._refused(i, {} if totals is None else totals)
        refused = counts[:len(REFUSAL_REASONS)]
        return {
            "remaining_requests": limits.level(rpm_i) if rpm else None,
            "remaining_tokens": limits.level(tpm_i) if tpm else None,
            "tokens_taken": limits.taken(tpm_i) if tpm else 0,
            "active": limits.active(rpm_i),
            "requests": limits.entered(rpm_i),
            "refused": dict(zip(REFUSAL_REASONS, refused, strict=True)),
            "tokens_in": counts[KF.TOKENS_IN],
            "tokens_out": counts[KF.TOKENS_OUT],
        }
