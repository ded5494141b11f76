"""Opening the ledger while another process holds its write lock (a second gateway on the same
state directory converting an older, large file): the opener says so and waits, instead of dying
at start-up with "database is locked" after SQLite's 5 s busy timeout."""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

import pytest

from velox.spend import ledger


class _Seen(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "locked by another process" in record.getMessage():
            self.waiting.set()


def test_a_writer_waits_for_another_process_holding_the_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / ledger.FILE_NAME
    ledger.connect(path).close()
    monkeypatch.setattr(ledger, "BUSY_S", 0.2)  # reach the wait at once rather than after 5 s
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # the other process's long conversion
    seen = _Seen()
    logging.getLogger("velox.ledger").addHandler(seen)
    opened: list[sqlite3.Connection | BaseException] = []

    def open_it() -> None:
        try:
            opened.append(ledger.connect(path))
        except BaseException as exc:  # handed to the test's thread
            opened.append(exc)

    opener = threading.Thread(target=open_it)
    try:
        opener.start()
        assert seen.waiting.wait(60), f"no waiting message; opener ended with {opened}"
        assert opened == []  # still waiting, not failed
    finally:
        holder.execute("COMMIT")
        holder.close()
        opener.join(60)
        logging.getLogger("velox.ledger").removeHandler(seen)
    assert len(opened) == 1 and isinstance(opened[0], sqlite3.Connection), opened
    conn = opened[0]
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 200  # back to the usual wait
    conn.close()


def test_a_lock_never_released_is_a_clear_start_up_error(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / ledger.FILE_NAME
    ledger.connect(path).close()
    monkeypatch.setattr(ledger, "BUSY_S", 0.1)
    monkeypatch.setattr(ledger, "OPEN_WAIT_S", 1)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(OSError, match=r"still locked by another process.*VELOX_STATE_DIR"):
            ledger.connect(path)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
