"""The ledger's rows hold one label id for their six names (key, team, route, upstream, model,
API): a file written with a column per name (the previous layout) is converted when a writer
opens it, keeping every row, its id (segments, the Redis Stream cursor) and what `velox spend`
reports; until then a read-only report reads it as it is.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from velox.spend import report
from velox.spend.ledger import LedgerWriter, Store, connect, make_row

NOW_MS = 1_795_700_000_000
# The previous layout, as earlier versions created it (names in the row, no labels table).
_BY_NAME = """
CREATE TABLE names (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
CREATE TABLE requests (
    id INTEGER PRIMARY KEY, ts_ms INTEGER NOT NULL,
    key_id INTEGER NOT NULL, team_id INTEGER NOT NULL, route_id INTEGER NOT NULL,
    upstream_id INTEGER NOT NULL, model_id INTEGER NOT NULL, api_id INTEGER NOT NULL,
    status INTEGER NOT NULL, input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL, cache_write_tokens INTEGER NOT NULL,
    reasoning_tokens INTEGER NOT NULL, cost_nanos INTEGER, latency_us INTEGER NOT NULL,
    request_id TEXT NOT NULL);
CREATE TABLE segments (id INTEGER PRIMARY KEY, min_ts INTEGER NOT NULL, max_ts INTEGER NOT NULL);
CREATE TABLE spend_daily (
    day TEXT NOT NULL, key_id INTEGER NOT NULL, team_id INTEGER NOT NULL,
    requests INTEGER NOT NULL, unpriced INTEGER NOT NULL, cost_nanos INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
    PRIMARY KEY (day, key_id, team_id)) WITHOUT ROWID;
CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE VIEW ledger AS
    SELECT r.id, r.ts_ms, k.name AS key, t.name AS team, ro.name AS route,
           u.name AS upstream, m.name AS model, a.name AS api, r.status,
           r.input_tokens, r.output_tokens, r.cached_tokens, r.cache_write_tokens,
           r.reasoning_tokens, r.cost_nanos, r.latency_us, r.request_id
    FROM requests r JOIN names k ON k.id = r.key_id JOIN names t ON t.id = r.team_id
    JOIN names ro ON ro.id = r.route_id JOIN names u ON u.id = r.upstream_id
    JOIN names m ON m.id = r.model_id JOIN names a ON a.id = r.api_id;
INSERT INTO meta VALUES ('schema', '1'), ('stream_cursor:velox:ledger', '4');
"""


def _rows(n: int) -> list[tuple[object, ...]]:
    return [make_row(ts_ms=NOW_MS + i, key=f"k{i % 3}", team="red" if i % 3 else "",
                     route="chat-r", upstream=f"up{i % 2}", model="gpt-x", api="chat",
                     status=200, input_tokens=10 + i, output_tokens=i, cached_tokens=i % 5,
                     cost_nanos=None if i % 7 == 0 else 1000 + i, latency_us=300 + i,
                     request_id=f"req-{i}") for i in range(n)]


def _old_file(path: Path, rows: list[tuple[object, ...]]) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(_BY_NAME)
    for name in sorted({str(v) for row in rows for v in row[1:7]}):
        conn.execute("INSERT INTO names (name) VALUES (?)", (name,))
    ids = dict(conn.execute("SELECT name, id FROM names"))
    # Ids from 11 on, as after a purge: the conversion must keep them.
    for row_id, row in enumerate(rows, 11):
        conn.execute("INSERT INTO requests VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                     (row_id, row[0], *(ids[v] for v in row[1:7]), *row[7:]))
    conn.execute("INSERT INTO segments VALUES (11, ?, ?)", (NOW_MS, NOW_MS + len(rows)))
    conn.commit()
    conn.close()


def _totals(conn: sqlite3.Connection, by: str) -> list[dict[str, object]]:
    return report.totals(conn, NOW_MS - 1000, NOW_MS + 10**6, by)


def test_a_file_with_a_column_per_name_is_converted_on_open(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    rows = _rows(40)
    _old_file(path, rows)
    reader = connect(path, readonly=True)  # a report before any writer opened it
    before = {by: _totals(reader, by) for by in ("key", "team", "upstream", "model", "day")}
    view_before = reader.execute("SELECT * FROM ledger ORDER BY id").fetchall()
    reader.close()
    assert sum(r["requests"] for r in before["key"]) == 40  # type: ignore[misc]

    conn = connect(path)
    columns = {c[1] for c in conn.execute("PRAGMA table_info(requests)")}
    assert "label_id" in columns and "key_id" not in columns
    assert conn.execute("SELECT COUNT(*) FROM labels").fetchone()[0] == 6  # 3 keys x 2 ups
    assert conn.execute("SELECT * FROM ledger ORDER BY id").fetchall() == view_before
    assert {by: _totals(conn, by) for by in before} == before
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()[0] == "2"
    conn.close()

    # A writer on the converted file: known labels reused, ids go on after the old ones, the
    # Redis mirror's rows decode to the same names.
    writer = LedgerWriter(path)
    writer.open()
    writer.submit(_rows(6))
    writer._drain()
    store = writer.store
    assert store is not None
    assert store.conn.execute("SELECT COUNT(*) FROM labels").fetchone()[0] == 6
    assert store.conn.execute("SELECT MIN(id), MAX(id) FROM requests").fetchone() == (11, 56)
    sent = store.rows_after(4, 100)
    assert [r[0] for r in sent] == list(range(11, 57))
    assert [r[1:] for r in sent] == [*rows, *_rows(6)]
    writer.close()
    # Opening it again converts nothing more.
    again = Store(connect(path))
    assert again.conn.execute("SELECT COUNT(*) FROM ledger").fetchone()[0] == 46
    again.conn.close()
