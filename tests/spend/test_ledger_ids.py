"""A ledger row's id is never given twice: when the retention purge removes the newest rows (a
host idle for longer than the retention), the rows written afterwards still get ids past
theirs, across a restart too, so the Redis mirror's cursor (by id) skips none of them; a file
from before this (no high-water mark, its rows all purged, its cursor past its ids) is given its
mark when a writer opens it.
"""

from __future__ import annotations

from pathlib import Path

from tests.e2e.conftest import wait_for
from velox.spend.ledger import DAY_MS, LAST_ID, STREAM, LedgerWriter, connect, make_row
from velox_lab.launch import RedisProcess

T0_MS = 1_795_700_000_000
CURSOR = f"stream_cursor:{STREAM}"


def _rows(n: int, ts_ms: int, prefix: str) -> list[tuple[object, ...]]:
    return [make_row(ts_ms=ts_ms + i, key="k", model="gpt-4o", input_tokens=3, output_tokens=1,
                     cost_nanos=100, request_id=f"{prefix}{i}") for i in range(n)]


class _Clock:
    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> float:
        return self.ms / 1000


def _write(writer: LedgerWriter, rows: list[tuple[object, ...]]) -> None:
    writer.submit(rows)
    writer._drain()


def _purge_all(writer: LedgerWriter, clock: _Clock) -> None:
    while writer.purge_step(clock()):
        pass


def _ids(path: Path) -> list[int]:
    conn = connect(path, readonly=True)
    try:
        return [r[0] for r in conn.execute("SELECT id FROM requests ORDER BY id")]
    finally:
        conn.close()


def test_ids_go_on_after_a_purge_took_the_newest_rows_and_after_a_restart(
        tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    clock = _Clock(T0_MS)
    writer = LedgerWriter(path, retention_days=1, clock=clock)
    writer.open()
    _write(writer, _rows(10, clock.ms, "a"))
    assert _ids(path) == list(range(1, 11))
    clock.ms += 2 * DAY_MS  # idle past the retention: every row goes, the newest included
    _purge_all(writer, clock)
    assert _ids(path) == []
    _write(writer, _rows(5, clock.ms, "b"))
    assert _ids(path) == list(range(11, 16))
    clock.ms += 2 * DAY_MS
    _purge_all(writer, clock)
    writer.close()
    # A restart on the emptied file: the mark is in the file, not only in the writer.
    again = LedgerWriter(path, retention_days=1, clock=clock)
    again.open()
    _write(again, _rows(3, clock.ms, "c"))
    assert _ids(path) == [16, 17, 18]
    store = again.store
    assert store is not None
    assert [r[-1] for r in store.rows_after(15, 100)] == ["c0", "c1", "c2"]
    assert store.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    again.close()


def test_a_file_from_before_the_mark_goes_on_after_its_cursor(tmp_path: Path) -> None:
    """As an earlier version left it: rows 1-10 sent to the stream (cursor 10), then all
    purged, and no high-water mark."""
    path = tmp_path / "ledger.sqlite3"
    clock = _Clock(T0_MS)
    writer = LedgerWriter(path, retention_days=1, clock=clock)
    writer.open()
    _write(writer, _rows(10, clock.ms, "old"))
    store = writer.store
    assert store is not None
    store.set_meta(CURSOR, "10")
    clock.ms += 2 * DAY_MS
    _purge_all(writer, clock)
    store.conn.execute("DELETE FROM meta WHERE name = ?", (LAST_ID,))  # as it was then
    writer.close()
    assert _ids(path) == []

    reopened = LedgerWriter(path, retention_days=1, clock=clock)
    reopened.open()
    _write(reopened, _rows(3, clock.ms, "new"))
    assert _ids(path) == [11, 12, 13]
    store = reopened.store
    assert store is not None and store.get_meta(LAST_ID) == "10"
    assert [r[-1] for r in store.rows_after(10, 100)] == ["new0", "new1", "new2"]
    reopened.close()


def _xlen(redis: RedisProcess) -> int:
    return int(redis.command("XLEN", STREAM)[1:].strip())  # RESP integer: b":N\r\n"


def test_the_stream_gets_the_rows_written_after_a_purge_emptied_the_file(
        tmp_path: Path, redis_server: RedisProcess) -> None:
    clock = _Clock(T0_MS)
    writer = LedgerWriter(tmp_path / "ledger.sqlite3", retention_days=1, clock=clock,
                          redis_url=redis_server.url, host="h", interval_s=0.02)
    writer.start()
    try:
        writer.submit(_rows(10, clock.ms, "before-"))
        wait_for(lambda: _xlen(redis_server) == 10, timeout=60)
        clock.ms += 2 * DAY_MS  # the writer's next pass purges all ten
        wait_for(lambda: writer.stats()["purged"] == 10, timeout=120)
        writer.submit(_rows(5, clock.ms, "after-"))
        wait_for(lambda: writer.stats()["written"] == 15, timeout=60)
        wait_for(lambda: writer.stats()["redis"]["sent"] == 15, timeout=60)
    finally:
        writer.close()
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:
        entries = client.xrange(STREAM)
    finally:
        client.close()
    assert [f[b"request_id"] for _, f in entries][10:] == [b"after-%d" % i for i in range(5)]
    assert [int(f[b"row"]) for _, f in entries] == list(range(1, 16))
