"""The ledger rows' binary frame (velox.spend.rowframe) between a worker's feed and the
supervisor's writer: rows come back exactly, rows that do not fit are left out and counted
without losing their frame, a broken frame is refused whole and counted, and the writer fed
frames writes the same file contents (rows, names, daily totals) as the writer fed rows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox.admin.control import FrameReader
from velox.admin.ledgerfeed import LedgerFeed
from velox.spend.ledger import LedgerWriter, Store, connect, make_row
from velox.spend.rowframe import COLUMNS, FRAME_COLUMNS, NO_COST, BadFrame, pack, rows_of, unpack

DAY_MS = 86_400_000
MIDNIGHT_MS = 1_795_737_600_000  # 2026-11-27T00:00:00Z
_INT64 = st.integers(-(1 << 63) + 1, (1 << 63) - 1)  # NO_COST itself is the wire's None
_TEXT = st.text(max_size=12)


def _row(draw: Any) -> tuple[Any, ...]:
    return (draw(_INT64), *(draw(_TEXT) for _ in range(6)), *(draw(_INT64) for _ in range(6)),
            draw(st.one_of(st.none(), _INT64)), draw(_INT64), draw(_TEXT))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_rows_come_back_as_they_were_packed(data: st.DataObject) -> None:
    rows = [_row(data.draw) for _ in range(data.draw(st.integers(1, 20)))]
    body, bad = pack(rows)
    assert bad == 0
    # A NUL inside a name or id would split it in two: it travels as U+FFFD.
    assert rows_of(unpack(body)) == [
        tuple(v.replace("\0", "\ufffd") if isinstance(v, str) else v for v in row)
        for row in rows]


def _good(n: int, ts_ms: int = MIDNIGHT_MS - 1000, prefix: str = "r") -> list[tuple[Any, ...]]:
    return [make_row(ts_ms=ts_ms + 100 * i, key=f"k{i % 3}", team="t" if i % 2 else "",
                     route="gpt", upstream="up", model="gpt-x", input_tokens=10 + i,
                     output_tokens=i, cost_nanos=None if i % 4 == 0 else 100 * i,
                     latency_us=5, request_id=f"{prefix}{i}") for i in range(n)]


def test_rows_that_do_not_fit_are_left_out_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    good = _good(4)
    wrong = [(*good[0][:8], None, *good[0][9:]),  # a token count that is not a number
             (*good[0][:8], 1.5, *good[0][9:]),  # nor an integer
             (*good[0][:15], 7),  # a request id that is not text
             good[0][:15],  # a field short
             (*good[0], "more"),  # one too many
             (*good[0][:13], 1 << 64, *good[0][14:])]  # past int64
    body, bad = pack([good[0], *wrong[:3], good[1], *wrong[3:], good[2], good[3]])
    assert bad == len(wrong) and rows_of(unpack(body)) == good

    frames: list[bytes] = []
    feed = LedgerFeed(frames.append, lambda: 0)
    for row in [*good, *wrong]:
        feed.add(row)
    with caplog.at_level(logging.WARNING, "velox.ledger"):
        assert feed.flush() == len(good)
    assert (feed.sent, feed.dropped, feed.bad) == (len(good), len(wrong), len(wrong))
    assert "6 rows did not fit the ledger's columns" in caplog.text
    (body,) = FrameReader().feed(frames[0])
    assert rows_of(unpack(body)) == good


def test_a_broken_frame_is_refused_whole_and_counted(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    body, _ = pack(_good(3))
    broken = [body[:-1] + b"\0",  # one more name than the rows need
              body[:40],  # truncated in the numbers
              b"{}",  # not a ledger frame
              body[:-2] + b"\xff\xfe"]  # not UTF-8
    for wrong in broken:
        with pytest.raises(BadFrame):
            unpack(wrong)
    writer = LedgerWriter(tmp_path / "ledger.sqlite3")
    writer.open()
    with caplog.at_level(logging.WARNING, "velox.ledger"):
        assert [writer.submit_frame(b) for b in [*broken, body]] == [0, 0, 0, 0, 3]
    writer._drain()
    assert writer.stats()["bad_frames"] == 4 and writer.stats()["written"] == 3
    assert "a frame of rows was dropped" in caplog.text
    writer.close()


def test_the_writer_fed_frames_writes_what_it_writes_fed_rows(tmp_path: Path) -> None:
    """Same rows, names, ledger view and daily totals, a frame across midnight (UTC)
    included; several frames and row lists in one transaction."""
    rows = _good(40) + _good(9, ts_ms=MIDNIGHT_MS - 5 * DAY_MS, prefix="old")
    by_rows = LedgerWriter(tmp_path / "rows.sqlite3", batch_rows=16)
    by_frames = LedgerWriter(tmp_path / "frames.sqlite3", batch_rows=16)
    for writer in (by_rows, by_frames):
        writer.open()
    by_rows.submit(rows)
    by_frames.submit(rows[:5])
    for start in range(5, len(rows), 7):  # [5, 12) crosses midnight
        by_frames.submit_frame(pack(rows[start:start + 7])[0])
    for writer in (by_rows, by_frames):
        writer._drain()
    assert by_frames.stats()["batches"] < len(rows) // 7  # frames share transactions
    dumps = []
    for writer in (by_rows, by_frames):
        writer.close()
        conn = connect(writer.path, readonly=True)
        dumps.append([conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2, 3").fetchall()
                      for table in ("ledger", "spend_daily")])
        conn.close()
    assert dumps[0] == dumps[1]
    ledger_rows, daily = dumps[1]
    assert sorted(r[1:] for r in ledger_rows) == sorted(rows)
    assert {d[0] for d in daily} == {"2026-11-22", "2026-11-26", "2026-11-27"}


def test_an_unknown_cost_is_not_a_number_on_the_wire() -> None:
    body, _ = pack([make_row(ts_ms=1, cost_nanos=None), make_row(ts_ms=2, cost_nanos=0)])
    frame = unpack(body)
    assert list(frame.columns[FRAME_COLUMNS.index("cost_nanos")]) == [NO_COST, 0]
    assert [r[COLUMNS.index("cost_nanos")] for r in rows_of(frame)] == [None, 0]


def test_a_label_travels_and_is_stored_once(tmp_path: Path) -> None:
    """Rows of a few keys and targets carry their six names once a label in the frame, and
    once a label in the file; each row holds its label's id."""
    rows = [make_row(ts_ms=i, key=f"key{i % 3}", team="t", route="r", upstream="u",
                     model=f"m{i % 2}", request_id=str(i)) for i in range(300)]
    frame = unpack(pack(rows)[0])
    assert len(frame.labels) == 6 and len(frame.columns[FRAME_COLUMNS.index("label")]) == 300
    store = Store(connect(tmp_path / "ledger.sqlite3"))
    writer = LedgerWriter(tmp_path / "ledger.sqlite3")
    writer.store = store
    writer.submit_frame(pack(rows)[0])
    writer._drain()
    conn = store.conn
    assert conn.execute("SELECT COUNT(*) FROM labels").fetchone()[0] == 6
    assert conn.execute("SELECT COUNT(DISTINCT label_id) FROM requests").fetchone()[0] == 6
    # A frame with one new name after known ones: one new name, one new label.
    writer.submit_frame(pack([make_row(ts_ms=2, key="key1", team="t", route="r",
                                       upstream="u", model="m2", request_id="x")])[0])
    writer._drain()
    assert conn.execute("SELECT COUNT(*) FROM labels").fetchone()[0] == 7
    assert conn.execute("SELECT COUNT(*) FROM names").fetchone()[0] == 10  # 9, then m2
    assert sorted(conn.execute("SELECT key, model, COUNT(*) FROM ledger GROUP BY 1, 2")) == [
        ("key0", "m0", 50), ("key0", "m1", 50), ("key1", "m0", 50), ("key1", "m1", 50),
        ("key1", "m2", 1), ("key2", "m0", 50), ("key2", "m1", 50)]
    conn.close()
