"""The ledger without an index on time: `segments` (first id, oldest and newest ts_ms of a run
of rows) find the rows of a period (`velox spend --since`) and the rows past retention by id,
exactly, rows that arrive late (older than rows already written) included; a file written
with the time index is converted when a writer opens it.
"""

from __future__ import annotations

import datetime as dt
import sqlite3
from pathlib import Path

from velox.spend import report
from velox.spend.ledger import SEGMENT_MS, LedgerWriter, Store, connect, first_id, make_row

DAY_MS = 86_400_000
NOW_MS = int(dt.datetime(2026, 11, 26, 12, tzinfo=dt.UTC).timestamp() * 1000)


def _rows(n: int, ts_ms: int, key: str) -> list[tuple[object, ...]]:
    return [make_row(ts_ms=ts_ms + i, key=key, cost_nanos=1000, input_tokens=1,
                     request_id=f"{key}{i}") for i in range(n)]


def _late_file(path: Path) -> Store:
    """Rows of now, late rows of ten days ago, rows of now again, one transaction each."""
    store = Store(connect(path))
    store.append(_rows(30, NOW_MS - 5_000, "now"))
    store.append(_rows(20, NOW_MS - 10 * DAY_MS, "late"))
    store.append(_rows(30, NOW_MS, "again"))
    store.append(_rows(5, NOW_MS + 2 * SEGMENT_MS, "next"))  # a segment of its own
    return store


def _keys(conn: sqlite3.Connection, since_ms: int,
          until_ms: int = NOW_MS + DAY_MS) -> dict[str, int]:
    return {r["key"]: r["requests"] for r in report.totals(conn, since_ms, until_ms, "key")}


def test_a_period_counts_its_rows_and_no_others_late_rows_included(tmp_path: Path) -> None:
    store = _late_file(tmp_path / "ledger.sqlite3")
    assert store.conn.execute("SELECT COUNT(*) FROM segments").fetchone()[0] == 2
    assert _keys(store.conn, NOW_MS - 7 * DAY_MS) == {"now": 30, "again": 30, "next": 5}
    assert _keys(store.conn, NOW_MS - 11 * DAY_MS) == {"now": 30, "late": 20, "again": 30,
                                                        "next": 5}
    assert _keys(store.conn, NOW_MS + SEGMENT_MS) == {"next": 5}
    assert _keys(store.conn, NOW_MS + DAY_MS - 1) == {}
    # The period's rows are read from an id on, not the whole table.
    plan = " ".join(str(r) for r in store.conn.execute(
        "EXPLAIN QUERY PLAN SELECT COUNT(*) FROM requests WHERE id >= ? AND ts_ms >= ?",
        (first_id(store.conn, NOW_MS + SEGMENT_MS), 0)))
    assert "INTEGER PRIMARY KEY (rowid>?)" in plan
    assert first_id(store.conn, NOW_MS + SEGMENT_MS) == 81  # the last segment's first row
    store.conn.close()


def test_retention_takes_late_rows_and_keeps_the_newer_ones_around_them(
        tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    _late_file(path).conn.close()
    writer = LedgerWriter(path, retention_days=7, clock=lambda: NOW_MS / 1000)
    writer.open()
    writer.purge_rows = 7  # several batches for the late rows
    while writer.purge_step(NOW_MS / 1000):
        pass
    assert writer.counts["purged"] == 20 and writer.counts["purge_batches"] >= 2
    assert writer.store is not None
    conn = writer.store.conn
    keys = dict(conn.execute("SELECT key, COUNT(*) FROM ledger GROUP BY key"))
    assert keys == {"now": 30, "again": 30, "next": 5}
    # The segment that held them now starts at its oldest remaining row's time.
    assert conn.execute("SELECT MIN(min_ts) FROM segments").fetchone()[0] == NOW_MS - 5_000
    # Everything past retention: rows and then their segments go, the open one included;
    # the next rows open a new one.
    later = (NOW_MS + 8 * DAY_MS) / 1000
    while writer.purge_step(later):
        pass
    assert conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM segments").fetchone()[0] == 0
    writer.submit(_rows(3, NOW_MS + 8 * DAY_MS, "fresh"))
    writer._drain()
    assert _keys(conn, NOW_MS + 8 * DAY_MS - 1, NOW_MS + 9 * DAY_MS) == {"fresh": 3}
    writer.close()


def test_a_file_with_the_time_index_is_converted_on_open(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    store = _late_file(path)
    store.conn.executescript("DROP TABLE segments; "
                             "CREATE INDEX requests_ts ON requests (ts_ms);")
    store.conn.close()
    reader = connect(path, readonly=True)  # a report before any writer opened it: all rows
    assert _keys(reader, NOW_MS - 7 * DAY_MS) == {"now": 30, "again": 30, "next": 5}
    reader.close()
    conn = connect(path)
    assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'requests_ts'"
                        ).fetchone() is None
    assert conn.execute("SELECT id, min_ts, max_ts FROM segments").fetchall() == [
        (1, NOW_MS - 10 * DAY_MS, NOW_MS + 2 * SEGMENT_MS + 4)]
    assert _keys(conn, NOW_MS - 7 * DAY_MS) == {"now": 30, "again": 30, "next": 5}
    conn.close()
