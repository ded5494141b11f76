"""Run-time keys in a worker without sockets: frames applied in order (a stale one ignored, a
full one replacing the set), the valid digests handed to the keys stage and Auth, a revoked
key refused at once even when its credential was accepted before, expiry and overlap ends
timed on the loop, and the shared table's indexes (claimed once, reused oldest first, None
when full)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from velox.admission.keys import KeyStage
from velox.admission.runtime import RuntimeKeys
from velox.config.settings import load
from velox.core.errors import Unauthorized
from velox.core.fields import F
from velox.ingress.auth import Auth
from velox.state import keys as state_keys
from velox.state.keys import SEGMENT_KEYS, SharedKeys
from velox.state.stats import Counters


class _Timer:
    def __init__(self, delay: float, fn: Any) -> None:
        self.delay, self.fn, self.cancelled = delay, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class _Loop:
    def __init__(self) -> None:
        self.timers: list[_Timer] = []

    def call_later(self, delay: float, fn: Any) -> _Timer:
        timer = _Timer(delay, fn)
        self.timers.append(timer)
        return timer


class _Worker:
    """What RuntimeKeys reads of a worker."""

    def __init__(self) -> None:
        settings = load({"VELOX_UPSTREAM_ORIGIN": "https://upstream.invalid"}, dotenv=None)
        self.tables = settings.tables
        self.shared = type("S", (), {"keys": SharedKeys((), slots=2)})()
        self.slot = 0
        self.counters = Counters(2, len(F))
        self.keys: Any = None
        self.auth = Auth(settings)
        self.loop = _Loop()
        self.ledgers = 0
        self.key_names: tuple[str, ...] = ()

    def publish_key_names(self, names: tuple[str, ...]) -> None:
        self.key_names = names

    def want_ledger(self) -> None:
        self.ledgers += 1

    def keys_stage(self) -> KeyStage:
        if self.keys is None:
            self.keys = KeyStage(self.tables, self.shared.keys, self.slot)
        return self.keys


def secret_row(name: str, index: int, secret: str, **extra: Any) -> dict[str, Any]:
    row = {"name": name, "index": index, "sha256": hashlib.sha256(secret.encode()).hexdigest(),
           "old_sha256": None, "old_until": None, "expires_at": None, "rpm": 0, "tpm": 0,
           "max_parallel": 0, "models": None}
    return {**row, **extra}


def bearer(secret: str) -> bytes:
    return b"Bearer " + secret.encode()


def valid(worker: _Worker, secret: str) -> bool:
    try:
        worker.auth.check(bearer(secret))
    except Unauthorized:
        return False
    return worker.keys.by_digest.get(hashlib.sha256(secret.encode()).digest()) is not None


def test_frames_apply_in_order_and_a_revoked_key_fails_at_once() -> None:
    worker = _Worker()
    keys = RuntimeKeys(worker)
    assert not worker.auth.required  # an open gateway, until its first run-time key
    assert keys.apply({"version": 1, "keys": [secret_row("a", 0, "sa")], "gone": []}) == 1
    assert worker.auth.required and valid(worker, "sa")
    assert worker.auth.check(bearer("sa")) is not None  # cached as accepted now
    keys.apply({"version": 2, "keys": [], "gone": ["a"]})
    assert not valid(worker, "sa")  # the cache of accepted credentials was dropped
    # An older frame arriving late changes nothing.
    assert keys.apply({"version": 1, "keys": [secret_row("a", 0, "sa")], "gone": []}) == 2
    assert not valid(worker, "sa")
    # No key left: the gateway still requires one (revoking never opens it).
    with pytest.raises(Unauthorized):
        worker.auth.check(None)


def test_a_full_frame_replaces_the_set_and_the_fork_time_one_never_blocks_later_frames(
        ) -> None:
    worker = _Worker()
    keys = RuntimeKeys(worker)
    keys.apply({"version": 7, "full": True, "initial": True, "gone": [],
                "keys": [secret_row("a", 0, "sa"), secret_row("b", 1, "sb", tpm=100)]})
    assert valid(worker, "sa") and valid(worker, "sb") and worker.ledgers
    assert keys.apply({"version": 5, "keys": [secret_row("c", 2, "sc")], "gone": []}) == 5
    assert valid(worker, "sc")
    keys.apply({"version": 9, "full": True, "keys": [secret_row("c", 2, "sc")], "gone": []})
    assert valid(worker, "sc") and not valid(worker, "sa") and not valid(worker, "sb")
    assert keys.apply({"version": 8, "full": True, "keys": [], "gone": []}) == 9
    # Each run-time key has its place in request.key's names after the file's keys (none
    # here), kept when it is gone (a late access-log line still names it) and when it comes
    # back changed.
    assert worker.key_names == ("a", "b", "c")
    keys.apply({"version": 10, "keys": [secret_row("a", 0, "sa2", rpm=5)], "gone": []})
    assert worker.key_names == ("a", "b", "c")
    assert worker.keys.by_digest[hashlib.sha256(b"sa2").digest()].book == 0


def test_expiry_and_overlap_end_are_timed_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    import velox.admission.runtime as runtime

    now = [1000.0]
    monkeypatch.setattr(runtime.time, "time", lambda: now[0])
    worker = _Worker()
    keys = RuntimeKeys(worker)
    rotated = secret_row("r", 0, "new", old_sha256=hashlib.sha256(b"old").hexdigest(),
                         old_until=1005.0)
    expiring = secret_row("e", 1, "se", expires_at=1010.0)
    keys.apply({"version": 1, "keys": [rotated, expiring], "gone": []})
    assert valid(worker, "new") and valid(worker, "old") and valid(worker, "se")
    (timer,) = [t for t in worker.loop.timers if not t.cancelled]
    assert timer.delay == pytest.approx(5.0, abs=0.1)  # the overlap's end comes first
    now[0] = timer.delay + 1000.0
    timer.fn()
    assert valid(worker, "new") and not valid(worker, "old") and valid(worker, "se")
    (timer,) = [t for t in worker.loop.timers if not t.cancelled]
    now[0] += timer.delay
    timer.fn()
    assert not valid(worker, "se") and valid(worker, "new")
    assert not [t for t in worker.loop.timers if not t.cancelled]


def test_table_indexes_are_claimed_once_reused_oldest_first_grow_and_run_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Two segments (8,192 keys) stand for the 1,000,000: the rule is the same.
    monkeypatch.setattr(state_keys, "MAX_SEGMENTS", 2)
    shared = SharedKeys((), slots=2)
    assert shared.segments == 1  # one segment made at start
    first = shared.claim("a")
    assert first == 0 and shared.claim("a") == 0
    assert shared.claim("b") == 1
    shared.unclaim("a")
    assert shared.claim("c") == 2  # a's index waits behind every never-used one
    for i in range(SEGMENT_KEYS - 3):
        assert shared.claim(f"k{i}") is not None
    assert shared.claim("d") == 0 and shared.segments == 1  # a's, before the table grows
    assert shared.claim("e") == SEGMENT_KEYS and shared.segments == 2  # full: it grew
    limits, rpm_i, _ = shared.entry(SEGMENT_KEYS)
    assert limits is shared.table.segments[1].limits and rpm_i == 0
    for i in range(SEGMENT_KEYS - 1):
        assert shared.claim(f"m{i}") is not None
    assert shared.claim("one-too-many") is None
    # A reload that keeps the table keeps the claims (one claim book for both).
    again = SharedKeys((), slots=2, previous=shared)
    assert again.claim("b") == 1 and again.claim("f") is None
    assert again.table is shared.table
