"""The supervisor's side of run-time keys: table indexes, shared limits, frames to the workers.

Every change the key store applies (this host's through the admin API, or another host's
read from Redis by the store's watcher) calls `KeyFeed.changed` under the store's lock; it only
queues the change. One thread takes the queue in order and, for each change:

1. claims each changed key's index in the shared key table of every running generation (a
   reload's old and new workers use different tables; `SharedKeys.claim`), sets its buckets
   when its rpm or tpm changed, and with VELOX_REDIS_URL leases them from Redis as
   `key:<name>:rpm|tpm`, like a file key's (velox.cluster.leases); a revoked key's index is
   given back and its leases dropped;
2. sends every worker the key table's segments it does not have yet (a claim that found the
   table full grew it by a segment of 4,096 keys: `segment` frames, the memfds passed over
   the slot's descriptor socket, velox.admin.control), then one `keys` control frame with the
   changed rows and the revoked names, with the indexes of that worker's own table
   (velox.admission.runtime applies it).

Why frames and not a shared generation counter the workers read: the counter would cost
every request (or every batch) a read of shared memory and a comparison, for changes that
come a few times a minute; a frame costs nothing until a change, and reaches an idle worker in
well under a millisecond, a busy one within one loop turn (its control socket is read between
the loop's callbacks), far inside the 1 s promised.

A worker that starts inherits the current set at fork (`initial`); right after its channel is
attached it is sent the whole set (`joined`), which covers a change made between the fork and
the attach. Frames carry the store's version; a worker ignores a frame older than what it has.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from velox.admin.control import ControlError, ControlHub
from velox.admin.keystore import KeyRecord, KeyStore
from velox.state.keys import SharedKeys

log = logging.getLogger("velox.keys")
# A worker maps a segment in its loop's next turn; a busy one may take a while. The frames
# after it wait for its answer (they name its keys), so the wait is bounded.
_SEGMENT_WAIT_S = 5.0


class KeyFeed:
    """`tables()` answers (the current table, {worker slot: the table its worker uses})."""

    def __init__(self, store: KeyStore, hub: ControlHub,
                 tables: Callable[[], tuple[SharedKeys, dict[int, SharedKeys]]],
                 cluster: Any = None, tpm_need: int = 0) -> None:
        self.store = store
        self.hub = hub
        self.tables = tables
        self.cluster = cluster
        self.tpm_need = tpm_need
        self.lock = threading.Lock()  # the tables' claims: the feed's thread and the supervisor's
        self.limits_set: dict[tuple[int, str], tuple[int, int]] = {}  # (table id, name) → set
        # Per worker slot: segments of its key table its worker has (inherited at fork, or
        # sent since); set by `forked` before the slot's channel is attached.
        self.segments_known: dict[int, int] = {}
        self.queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        store.on_change(self.changed)

    # --- the supervisor's thread ------------------------------------------------------------

    def adopt(self, keys: SharedKeys) -> None:
        """Claim every run-time key in `keys`, the start's or a reload's table (the current
        one: its buckets are the ones leased), before its workers fork."""
        _, records = self.store.snapshot()
        with self.lock:
            for record in records:
                self._claim(keys, record, lease=True, again=True)

    def initial(self, keys: SharedKeys) -> dict[str, Any]:
        """In a freshly forked worker: the run-time keys of its table, as one full frame. No
        lock is taken: the threads that might hold them do not exist in the child."""
        by_name = self.store.by_name
        rows = [row(by_name[name], index) for name, index in list(keys.runtime.items())
                if name in by_name]
        return {"version": self.store.version, "full": True, "initial": True, "keys": rows,
                "gone": []}

    def forked(self, slot: int, segments: int) -> None:
        """A worker was forked for `slot` holding (at least) `segments` segments."""
        self.segments_known[slot] = segments

    def joined(self, slot: int) -> None:
        """The worker of `slot` has started: send it the whole set."""
        self.queue.put(("full", slot))

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="velox-keyfeed", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join(5)

    # --- the store's listener ---------------------------------------------------------------

    def changed(self, version: int, upserts: list[KeyRecord], gone: list[str]) -> None:
        self.queue.put(("change", version, upserts, gone))

    # --- the feed's thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            try:
                if item[0] == "full":
                    version, records = self.store.snapshot()
                    self._send(version, records, [], full=True, only=item[1])
                else:
                    self._send(*item[1:], full=False)
            except Exception:
                log.exception("run-time keys: a change could not be sent to the workers")

    def _send(self, version: int, records: list[KeyRecord], gone: list[str], *, full: bool,
              only: int | None = None) -> None:
        current, by_slot = self.tables()
        frames: dict[int, dict[str, Any]] = {}
        with self.lock:
            tables = {id(k): k for k in (current, *by_slot.values())}
            for keys in tables.values():
                lease = keys is current
                for name in gone:
                    self._unclaim(keys, name, lease)
            claimed = {t: [(r, self._claim(keys, r, lease=keys is current))
                           for r in records] for t, keys in tables.items()}
        for slot, keys in by_slot.items():
            if only is not None and slot != only:
                continue
            pairs = claimed[id(keys)]
            self._send_segments(slot, keys)
            frames[slot] = {
                "version": version, "full": full,
                "keys": [row(r, index) for r, index in pairs if index is not None],
                "gone": gone + [r.name for r, index in pairs if index is None]}
        for slot, frame in frames.items():
            try:
                self.hub.send(slot, "keys", **frame)  # answered with the version applied
            except ControlError:
                pass  # not running: it gets the whole set when it starts (joined)

    def _send_segments(self, slot: int, keys: SharedKeys) -> None:
        """The segments of `keys`' table the worker of `slot` lacks, in order, before any
        frame naming their keys."""
        table = keys.table
        have = self.segments_known.get(slot, 0)
        while have < len(table.segments):
            fds = table.fds(have)
            try:
                self.hub.call(slot, "segment", _SEGMENT_WAIT_S, fds=fds, segment=have,
                              count=len(fds))
            except ControlError as exc:
                log.warning("worker %d did not map key-table segment %d (%s); it is sent again "
                            "with the next change", slot, have, exc)
                return
            finally:
                for fd in fds:
                    os.close(fd)
            have += 1
            self.segments_known[slot] = have

    def _claim(self, keys: SharedKeys, record: KeyRecord, lease: bool,
               again: bool = False) -> int | None:
        index = keys.claim(record.name)
        if index is None:
            log.error("run-time key %r cannot be enforced: the key table is full (%d keys); "
                      "its requests are refused (401) until keys are revoked", record.name,
                      len(keys.runtime) + len(keys.keys))
            return None
        limits = (record.rpm, record.tpm)
        mark = (id(keys), record.name)
        if again or self.limits_set.get(mark) != limits:
            self.limits_set[mark] = limits
            keys.set_limits(index, record.rpm, record.tpm)
            if lease and self.cluster is not None:
                self._lease(keys, record, index)
        return index

    def _lease(self, keys: SharedKeys, record: KeyRecord, index: int) -> None:
        """Share the key's buckets with the other hosts, as a file key's (supervisor)."""
        name = record.name
        limits, rpm_i, tpm_i = keys.entry(index)
        self.cluster.remove(f"key:{name}:")
        if record.rpm:
            self.cluster.add(f"key:{name}:rpm", limits, rpm_i, record.rpm, record.rpm)
        if record.tpm:
            self.cluster.add(f"key:{name}:tpm", limits, tpm_i, record.tpm, record.tpm,
                             self.tpm_need)

    def _unclaim(self, keys: SharedKeys, name: str, lease: bool) -> None:
        keys.unclaim(name)
        self.limits_set.pop((id(keys), name), None)
        if lease and self.cluster is not None:
            self.cluster.remove(f"key:{name}:")


def row(record: KeyRecord, index: int) -> dict[str, Any]:
    """What a worker needs of a key to enforce it (velox.admission.runtime): no secret."""
    return {"name": record.name, "index": index, "sha256": record.sha256,
            "old_sha256": record.old_sha256, "old_until": record.old_until,
            "expires_at": record.expires_at, "rpm": record.rpm, "tpm": record.tpm,
            "max_parallel": record.max_parallel,
            "models": list(record.models) if record.models is not None else None}
