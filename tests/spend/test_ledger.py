"""The usage ledger in one process, on real SQLite files: rows, names and the `ledger` view,
daily totals that budgets resume from, bad rows skipped without losing their batch, the bounded
queue, the retention purge in small batches while rows keep arriving, the daily fold, and the
reports (`totals`, periods, groupings).
"""

from __future__ import annotations

import datetime as dt
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import wait_for
from velox.spend import ledger, report
from velox.spend.ledger import EARLIER, LedgerWriter, Spent, Store, connect, make_row

DAY_MS = 86_400_000
NOW_MS = int(dt.datetime(2026, 11, 26, 12, tzinfo=dt.UTC).timestamp() * 1000)


def _rows(n: int, ts_ms: int = NOW_MS, key: str = "alice", team: str = "red",
          cost: int | None = 1000, prefix: str = "r", **kw: Any) -> list[tuple[Any, ...]]:
    return [make_row(ts_ms=ts_ms, key=key, team=team, route="gpt-4o", upstream="openai",
                     model="gpt-4o-2024-08-06", input_tokens=10, output_tokens=3,
                     cost_nanos=cost, latency_us=1500, request_id=f"{prefix}{i}", **kw)
            for i in range(n)]



def test_rows_names_view_and_daily_totals(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    writer = LedgerWriter(path, clock=lambda: NOW_MS / 1000, interval_s=0.02)
    writer.start()
    writer.submit(_rows(3))
    writer.submit(_rows(2, key="bob", team="blue", cost=None, prefix="b"))
    writer.submit(_rows(1, ts_ms=NOW_MS - DAY_MS, prefix="y"))  # yesterday
    writer.close()
    assert writer.stats()["written"] == 6

    conn = connect(path, readonly=True)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    first = conn.execute("SELECT * FROM ledger ORDER BY id LIMIT 1").fetchone()
    assert first == (1, NOW_MS, "alice", "red", "gpt-4o", "openai", "gpt-4o-2024-08-06",
                     "chat", 200, 10, 3, 0, 0, 0, 1000, 1500, "r0")
    # Names are stored once, whatever the number of rows.
    assert conn.execute("SELECT COUNT(*) FROM names").fetchone()[0] == 8
    store = Store(conn)
    assert store.spent("key") == {"alice": Spent(4, 0, 4000), "bob": Spent(2, 2, 0)}
    assert store.spent("team", since_day="2026-11-26") == {"red": Spent(3, 0, 3000),
                                                           "blue": Spent(2, 2, 0)}


def test_totals_survive_a_restart_and_period_starts_are_utc(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    for _ in range(2):  # a second writer on the same file adds to the first one's totals
        writer = LedgerWriter(path, clock=lambda: NOW_MS / 1000)
        writer.start()
        writer.submit(_rows(5))
        writer.close()
    assert Store(connect(path, readonly=True)).spent("key") == {"alice": Spent(10, 0, 10_000)}
    thursday = NOW_MS  # 2026-11-26 is a Thursday
    assert ledger.period_start("day", thursday) == "2026-11-26"
    assert ledger.period_start("week", thursday) == "2026-11-23"
    assert ledger.period_start("month", thursday) == "2026-11-01"
    assert ledger.period_start("total", thursday) == EARLIER
    # 23:59:59.999 UTC on the 30th is still November; a millisecond later is December.
    end = int(dt.datetime(2026, 12, 1, tzinfo=dt.UTC).timestamp() * 1000)
    assert ledger.period_start("month", end - 1) == "2026-11-01"
    assert ledger.period_start("month", end) == "2026-12-01"
    with pytest.raises(ValueError, match="unknown budget period 'year'"):
        ledger.period_start("year", thursday)


def test_a_bad_row_is_skipped_and_its_batch_is_kept(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "ledger.sqlite3"
    writer = LedgerWriter(path, clock=lambda: NOW_MS / 1000)
    writer.start()
    good = _rows(3)
    writer.submit([good[0], (1, 2, 3), good[1], [*good[2][:8], "many", *good[2][9:]]])
    writer.close()
    assert writer.stats()["written"] == 2 and writer.stats()["skipped"] == 2
    ids = [r[0] for r in connect(path, readonly=True).execute(
        "SELECT request_id FROM requests ORDER BY id")]
    assert ids == ["r0", "r1"]
    assert "ledger: a row was skipped" in caplog.text


def test_the_queue_is_bounded_and_drops_are_counted(tmp_path: Path) -> None:
    writer = LedgerWriter(tmp_path / "ledger.sqlite3", queue_max=1000)
    writer.open()  # not started: nothing drains
    assert writer.submit(_rows(600)) == 600
    assert writer.submit(_rows(600)) == 400
    assert writer.submit(_rows(5)) == 0
    assert writer.stats()["queued"] == 1000 and writer.stats()["dropped"] == 205
    writer.start()
    writer.close()
    assert writer.stats()["written"] == 1000


def _fill_old(path: Path, rows: int, age_days: int) -> None:
    """`rows` rows `age_days` old, written straight through a Store (fast: big batches)."""
    store = Store(connect(path))
    old = NOW_MS - age_days * DAY_MS
    for start in range(0, rows, 50_000):
        store.append(_rows(min(50_000, rows - start), ts_ms=old, key="old", prefix="o"))
    store.conn.close()


def test_retention_purges_a_big_table_in_small_batches_while_rows_keep_arriving(
        tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    old_rows = 400_000
    _fill_old(path, old_rows, age_days=10)
    writer = LedgerWriter(path, retention_days=7, clock=lambda: NOW_MS / 1000,
                          interval_s=0.01)
    writer.start()
    stop = threading.Event()
    sent = [0]

    def producer() -> None:  # new rows all along, as a busy gateway would send them
        while not stop.is_set():
            writer.submit(_rows(50, prefix=f"n{sent[0]}-"))
            sent[0] += 50
            time.sleep(0.002)

    thread = threading.Thread(target=producer)
    thread.start()
    # Rows written while the purge was under way (some, but not all, of the old rows gone).
    during: list[int] = []

    def watch() -> bool:
        s = writer.stats()
        if 0 < s["purged"] < old_rows:
            during.append(s["written"])
        return bool(s["purged"] == old_rows)

    try:
        wait_for(watch, timeout=60)  # the purge of the old rows
    finally:
        stop.set()
        thread.join()
    writer.close()
    stats = writer.stats()
    # Many small transactions, never one big delete ...
    assert stats["purge_batches"] >= old_rows // ledger.PURGE_ROWS_MAX
    assert writer.purge_rows <= ledger.PURGE_ROWS_MAX
    # ... with new rows committed between them.
    assert len(during) >= 2 and during[-1] > during[0], during
    conn = connect(path, readonly=True)
    assert conn.execute("SELECT COUNT(*) FROM requests WHERE ts_ms < ?",
                        (NOW_MS - 7 * DAY_MS,)).fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == sent[0]
    assert stats["written"] == sent[0] and stats["dropped"] == 0
    # The old spend is still in the daily totals after its rows went.
    assert Store(conn).spent("key")["old"] == Spent(old_rows, 0, old_rows * 1000)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_old_daily_totals_fold_into_one_row_and_keep_their_sum(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    store = Store(connect(path))
    for age in (900, 800, 500, 3):
        store.append(_rows(2, ts_ms=NOW_MS - age * DAY_MS))
    before = store.spent("key")
    store.conn.close()
    writer = LedgerWriter(path, retention_days=1, clock=lambda: NOW_MS / 1000)
    writer.start()
    # Purged, and the fold done (the next purge is then a minute away).
    wait_for(lambda: writer.stats()["purged"] == 8 and writer._next_purge > NOW_MS / 1000,
             timeout=60)
    writer.close()
    conn = connect(path, readonly=True)
    days = [d for (d,) in conn.execute("SELECT day FROM spend_daily ORDER BY day")]
    assert days == [EARLIER, "2026-11-23"]
    assert Store(conn).spent("key") == before == {"alice": Spent(8, 0, 8000)}
    assert Store(conn).spent("key", since_day="2026-11-01") == {"alice": Spent(2, 0, 2000)}


# --- reports --------------------------------------------------------------------------------


@pytest.fixture
def reported(tmp_path: Path) -> sqlite3.Connection:
    store = Store(connect(tmp_path / "ledger.sqlite3"))
    store.append(_rows(3, key="alice", team="red"))
    store.append(_rows(2, key="bob", team="red", cost=5000, ts_ms=NOW_MS - DAY_MS))
    store.append(_rows(4, key="carol", team="", cost=None))
    store.append(_rows(1, key="bob", team="red", ts_ms=NOW_MS - 30 * DAY_MS))
    return store.conn


def test_totals_by_key_team_and_day(reported: sqlite3.Connection) -> None:
    week = report.parse_time("7d", NOW_MS + 1)
    by_key = report.totals(reported, week, NOW_MS + 1, "key")
    assert by_key == [
        {"key": "bob", "requests": 2, "input_tokens": 20, "output_tokens": 6,
         "cost_usd": 1e-05, "unpriced_requests": 0},
        {"key": "alice", "requests": 3, "input_tokens": 30, "output_tokens": 9,
         "cost_usd": 3e-06, "unpriced_requests": 0},
        # Unknown cost is null, never 0.
        {"key": "carol", "requests": 4, "input_tokens": 40, "output_tokens": 12,
         "cost_usd": None, "unpriced_requests": 4}]
    by_team = report.totals(reported, week, NOW_MS + 1, "team")
    assert [(r["team"], r["requests"], r["cost_usd"]) for r in by_team] == [
        ("red", 5, 1.3e-05), ("", 4, None)]
    by_day = report.totals(reported, 0, NOW_MS + 1, "day")
    assert [(r["day"], r["requests"]) for r in by_day] == [
        ("2026-11-25", 2), ("2026-11-26", 7), ("2026-10-27", 1)]
    text = report.format_totals(by_key, "key", "# header")
    assert text.splitlines()[0] == "# header"
    assert text.splitlines()[-1].split() == ["total", "9", "90", "27", "0.000013", "4"]


def test_periods_and_groupings_are_checked() -> None:
    assert report.parse_time("24h", NOW_MS) == NOW_MS - DAY_MS
    assert report.parse_time("30m", NOW_MS) == NOW_MS - 1_800_000
    assert report.parse_time("2w", NOW_MS) == NOW_MS - 14 * DAY_MS
    assert report.parse_time("2026-11-26", NOW_MS) == NOW_MS - 12 * 3_600_000
    for bad in ("7", "7y", "yesterday", "", "-1d"):
        with pytest.raises(report.BadQuery, match="expected a span like 7d"):
            report.parse_time(bad, NOW_MS)
    with pytest.raises(report.BadQuery, match="by='cost': expected one of key, team"):
        report.check_group("cost")


def test_local_totals_of_a_missing_or_disabled_ledger(tmp_path: Path) -> None:
    assert report.local_totals(str(tmp_path / "none"), "7d", None, "key", NOW_MS) == []
    with pytest.raises(report.NoLedger):
        report.local_totals("off", "7d", None, "key", NOW_MS)


# --- the worker's feed ------------------------------------------------------------------------


def test_the_feed_ships_one_frame_per_flush_and_drops_counted_rows_when_full() -> None:
    from velox.admin.control import FrameReader
    from velox.admin.ledgerfeed import LedgerFeed
    from velox.spend.rowframe import rows_of, unpack

    frames: list[bytes] = []
    backlog = [0]
    feed = LedgerFeed(frames.append, lambda: backlog[0], rows_max=100, backlog_max=1000)
    for row in _rows(120):
        feed.add(row)
    assert feed.dropped == 20 and feed.flush() == 100 and feed.flush() == 0
    (body,) = FrameReader().feed(frames[0])
    assert rows_of(unpack(body)) == _rows(100)
    backlog[0] = 1000  # the supervisor stopped reading: nothing more is buffered
    for row in _rows(10):
        feed.add(row)
    assert feed.flush() == 0 and len(frames) == 1
    assert (feed.sent, feed.dropped) == (100, 30)


def test_names_of_a_rolled_back_batch_are_forgotten(tmp_path: Path) -> None:
    """A batch that fails rolls back the names it added; later rows must not point at them."""
    store = Store(connect(tmp_path / "ledger.sqlite3"))

    def fail() -> None:
        raise sqlite3.OperationalError("disk I/O error")

    with pytest.raises(sqlite3.OperationalError):
        store.append(_rows(1, key="ghost"), extra=fail)
    store.append(_rows(1, key="ghost"))
    assert store.conn.execute("SELECT key FROM ledger").fetchall() == [("ghost",)]


_FIELD = st.one_of(st.integers(-5, 5), st.booleans(), st.none(), st.text(max_size=3),
                   st.floats(allow_nan=False), st.binary(max_size=2))


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_the_row_check_takes_what_the_field_by_field_check_takes(data: st.DataObject) -> None:
    """The writer's one-tuple type test (every well-formed row) decides as the field-by-field
    check it falls back on: the same rows kept, with the same values. Rows are well-formed
    ones with up to three fields replaced by any value, or of another length."""
    fields: list[object] = [1, "k", "t", "r", "u", "m", "chat", 200, 1, 2, 0, 0, 0,
                            data.draw(st.one_of(st.none(), st.integers(0, 9))), 5, "id"]
    for _ in range(data.draw(st.integers(0, 3))):
        fields[data.draw(st.integers(0, len(fields) - 1))] = data.draw(_FIELD)
    if data.draw(st.integers(0, 9)) == 0:
        fields = fields[:-1] if data.draw(st.booleans()) else [*fields, 1]
    store = Store(connect(":memory:"))
    assert store._checked(list(fields)) == store._checked_slowly(list(fields))
