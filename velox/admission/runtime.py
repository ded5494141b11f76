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

    def apply(self, frame: dict[str, Any]) -> int:
        """Apply one frame; returns the version this worker has now."""
        version = int(frame["version"])
        if frame.get("full"):
            if version < self.version:
                return self.version
            self.rows = {row["name"]: row for row in frame["keys"]}
        else:
            if version <= self.version:
                return self.version
            for name in frame.get("gone", ()):
                self.rows.pop(name, None)
            for row in frame["keys"]:
                self.rows[row["name"]] = row
        # The fork-time set carries the store's version but may miss changes queued for the
        # worker: it never makes a later frame look stale.
        self.version = -1 if frame.get("initial") else version
        if self.rows or version > 0:
            self.refresh()
        return self.version

    def refresh(self) -> None:
        """Rebuild the valid set from the rows at the current time; time the next change."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        worker = self.worker
        stage = worker.keys_stage()  # made on the first key by a gateway without [[key]]
        now = time.time()
        soonest = float("inf")
        live = {}
        for row in self.rows.values():
            expires = row["expires_at"]
            if expires is not None:
                if expires <= now:
                    continue
                soonest = min(soonest, expires)
            key = stage.runtime_key(row["index"], spec_of(row))
            live[bytes.fromhex(row["sha256"])] = key
            until = row["old_until"]
            if row["old_sha256"] is not None and until is not None and until > now:
                live.setdefault(bytes.fromhex(row["old_sha256"]), key)
                soonest = min(soonest, until)
            if row["tpm"]:
                worker.want_ledger()  # a tpm is settled from usage: meter keyed requests
        stage.use_runtime(live)
        worker.auth.use_runtime(frozenset(live))
        if soonest != float("inf"):
            self.timer = worker.loop.call_later(soonest - now + _LATE_S, self.refresh)

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
