"""A worker's run-time keys: the supervisor's `keys` frames applied to its keys stage and auth.

The admin API's keys (velox.admin.keystore) reach the workers as control frames
(velox.admin.keyfeed): `{"cmd": "keys", "version": v, "full": bool, "keys": [row, ...],
"gone": [name, ...]}`, a row holding what enforcement needs (name, table index, the hashes,
the overlap's and the expiry's end, limits; never a secret). A frame older than what the
worker has applied is ignored; a full one replaces the whole set.

Applying rebuilds the set of valid digests once (a dict of the live keys, file keys first) and
hands it to the keys stage and to Auth in two assignments made in one loop callback, so a
request sees the old set or the new one. Times (an expiry, the end of a rotation's overlap)
are a timer on the loop at the earliest of them, which rebuilds the set again: the request
path never reads the clock for them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from velox.config.tables import KeySpec
from velox.core.fields import F

log = logging.getLogger("velox.keys")
# A timer fires this much after the time it waits for, so the rebuild finds it past (the loop's
# clock and time.time() are different clocks; 10 ms is far inside the 1 s promised).
_LATE_S = 0.01


class RuntimeKeys:
    """Per worker: `apply(frame)` on every `keys` frame, on the loop's thread."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.version = -1
        self.rows: dict[str, dict[str, Any]] = {}
        self.timer: Any = None
        # The _Key and digests made for each row, by name: kept while its row is the same
        # object, so a rebuild makes no key again.
        self.made: dict[str, tuple[dict[str, Any], Any, bytes, bytes | None]] = {}
        # The valid set (digest → key; None until the first rebuild), each key's digests in it,
        # and the earliest time that changes it (the timer's).
        self.live: dict[bytes, Any] | None = None
        self.digests_of: dict[str, list[bytes]] = {}
        self.soonest = float("inf")

    def apply(self, frame: dict[str, Any]) -> int:
        """Apply one frame; returns the version this worker has now."""
        version = int(frame["version"])
        changed: list[dict[str, Any]] | None = None
        gone: list[str] = []
        if frame.get("full"):
            if version < self.version:
                return self.version
            self.rows = {row["name"]: row for row in frame["keys"]}
        else:
            if version <= self.version:
                return self.version
            gone = list(frame.get("gone", ()))
            for name in gone:
                self.rows.pop(name, None)
            changed = frame["keys"]
            for row in changed:
                self.rows[row["name"]] = row
        # The fork-time set carries the store's version but may miss changes queued for the
        # worker: it never makes a later frame look stale.
        self.version = -1 if frame.get("initial") else version
        worker = self.worker
        worker.counters.set(worker.slot, F.KEYS_VERSION, self.version)
        if self.rows or version > 0:
            if changed is None or self.live is None:
                self.refresh()
            else:
                self._update(changed, gone)
        return self.version

    def refresh(self) -> None:
        """Rebuild the valid set from the rows at the current time; time the next change."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.live, self.digests_of, self.soonest = {}, {}, float("inf")
        self.made = {name: m for name, m in self.made.items() if name in self.rows}
        self._update(list(self.rows.values()), [])

    def _update(self, changed: list[dict[str, Any]], gone: list[str]) -> None:
        """Take the keys of `gone` and of `changed` out of the valid set, put `changed` back
        in as they are now, and publish: a change costs its own rows plus two set copies
        (about 0.1 us a key), not every key's rebuild (5,000 keys made one by one would cost
        a worker O(n^2), seconds of a silent loop)."""
        worker = self.worker
        stage = worker.keys_stage()  # made on the first key by a gateway without [[key]]
        live, digests_of, made = self.live, self.digests_of, self.made
        assert live is not None
        for name in (*gone, *(row["name"] for row in changed)):
            for digest in digests_of.pop(name, ()):
                live.pop(digest, None)
        for name in gone:
            made.pop(name, None)
        now = time.time()
        soonest = self.soonest
        for row in changed:
            expires = row["expires_at"]
            if expires is not None:
                if expires <= now:
                    continue
                soonest = min(soonest, expires)
            keyed = self._key(stage, row)
            if keyed is None:
                continue
            key, digest, old_digest = keyed
            live[digest] = key
            mine = [digest]
            until = row["old_until"]
            if old_digest is not None and until is not None and until > now:
                if old_digest not in live:
                    live[old_digest] = key
                    mine.append(old_digest)
                soonest = min(soonest, until)
            digests_of[row["name"]] = mine
            if row["tpm"]:
                worker.want_ledger()  # a tpm is settled from usage: meter keyed requests
        stage.use_runtime(live)
        worker.auth.use_runtime(frozenset(live))
        worker.publish_key_names(stage.names.publish())
        if soonest != self.soonest or self.timer is None:
            self._time(soonest, now)

    def _time(self, soonest: float, now: float) -> None:
        """The next expiry or end of an overlap rebuilds the whole set (`refresh`)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.soonest = soonest
        if soonest != float("inf"):
            self.timer = self.worker.loop.call_later(soonest - now + _LATE_S, self.refresh)

    def _key(self, stage: Any, row: dict[str, Any]) -> tuple[Any, bytes, bytes | None] | None:
        """(the stage's key, its digest, the previous secret's) for `row`, made once per row;
        None if its segment of the key table is not mapped here (the supervisor sends
        segments before the keys naming them)."""
        made = self.made.get(row["name"])
        if made is not None and made[0] is row:
            return made[1:]
        try:
            key = stage.runtime_key(row["index"], spec_of(row))
        except IndexError:
            log.error("run-time key %r: its place %d in the key table is not mapped in this "
                      "worker; it is refused until the next change", row["name"], row["index"])
            return None
        old = row["old_sha256"]
        made = self.made[row["name"]] = (row, key, bytes.fromhex(row["sha256"]),
                                         bytes.fromhex(old) if old is not None else None)
        return made[1:]

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def spec_of(row: dict[str, Any]) -> KeySpec:
    """A frame's row as the keys stage reads a `[[key]]` table (run-time keys never forward
    past their models or tpm: the default rule of file keys)."""
    models = row["models"]
    return KeySpec(name=row["name"], sha256=row["sha256"], rpm=row["rpm"], tpm=row["tpm"],
                   max_parallel=row["max_parallel"],
                   models=tuple(models) if models is not None else None)
