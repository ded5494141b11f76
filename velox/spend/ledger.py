"""The usage ledger: one row per settled request, in one SQLite file per host.

A row (`COLUMNS`, a plain tuple: it is built on the hot path and shipped by column in a
binary frame, velox.spend.rowframe) holds the time, the gateway key and its team, the route,
upstream, model and API (chat, messages, embeddings, ...), the status, the input / output /
cached / cache-write / reasoning tokens, the cost in nano-USD (None: the model has no price,
velox.spend.prices), the latency in microseconds and the request id.

Who writes: the supervisor, one `LedgerWriter` thread per host, fed by the workers over their
control channels (velox.admin.ledgerfeed builds the frames in a worker; control.py hands them to
`LedgerWriter.submit_frame`). Why not a writer thread in each worker:

* One writer per file. SQLite (WAL or not) lets one connection write at a time; N workers
  writing one file would queue on its write lock and sleep in its busy handler, and each
  would run the checkpoints and the retention purge, or need an election to decide who does.
  One writer also makes "one file per host" true by construction.
* The workers' CPU is what serves requests. A worker only appends a tuple (~0.1 us) and,
  every `feed.FLUSH_S`, packs its rows by column (~0.5 us a row) and writes one frame to the
  socket it already has (never blocking: a full socket drops rows, counted). The inserts,
  index updates, checkpoints, purges and the Redis mirror cost the supervisor's thread.
* SIGKILL. A worker killed loses only the rows it had not yet flushed (at most one
  `feed.FLUSH_S` of its requests); frames already written are in the socket and the
  supervisor still reads them. The supervisor killed loses the rows queued in its writer
  (at most `INTERVAL_S` plus what the sockets held). Neither corrupts the file: every batch is
  one transaction in WAL mode, which a killed process leaves either committed or absent
  (synchronous=NORMAL: committed batches survive any process crash; an OS crash or power loss
  may lose the last ones, never the file). The same holds for a writer killed mid-purge.

Memory is bounded everywhere: the writer's queue holds at most `QUEUE_MAX` rows (more are
dropped and counted, `stats()["dropped"]`), a batch is at most `BATCH_ROWS` rows, and the
retention purge deletes at most `purge_rows` rows per transaction, adapting that number so one
batch takes about `PURGE_BUDGET_S` (a purge of millions of rows is thousands of short
transactions with inserts between them: it never stalls the writer, nor grows its memory).

Storage: repeated names (keys, teams, routes, upstreams, models, APIs) are stored once in
`names`, and each combination of the six that rows use (a label: a key's requests to one
route's upstream and model, over one API) once in `labels`; a row holds its label's id, 11
columns instead of 16 (the insert binds ~30% fewer values, and the row is smaller:
`benches/bench_ledger.py` measures both). The `ledger` view joins them back for people and
exports. A file written with a column per name (an earlier version) is converted when a writer
opens it. No index on ts_ms: `segments` (SEGMENT_MS) find a period's rows by id.

A row's id is never given twice, even once its row is gone: the Redis mirror's cursor, the
segments and a reader deduplicating the stream by (host, row) rely on it. SQLite gives a new row
the largest id in the table plus one, so a purge that removed the newest rows (a host idle for
longer than the retention) would hand their ids out again. The purge that removes the newest
row keeps its id in `meta` (`last_id`, same transaction), and the next batch starts after it.
(AUTOINCREMENT does the same for every insert: +0.45 us a row on a ~1.1 us insert on this
machine, measured with 200,000 rows in batches of 4,096; this costs a query per purge batch.)
A file from before this note is given its `last_id` when a writer opens it: the largest of its
ids and its mirror cursors, so rows written after a purge that emptied it reach the stream.
`spend_daily` keeps the spend per UTC day, key and team, updated in the same transaction as
the rows, and kept after the rows are purged (days older than `DAILY_KEEP_DAYS` are folded
into one "earlier" row per key and team): budgets resume from it after a restart (`spent`).

With VELOX_REDIS_URL the writer also ships the rows to a Redis Stream (`STREAM`, capped with
XADD MAXLEN ~), so one reader sees every host: after each batch it sends the rows past a cursor
kept in the file (at-least-once: a crash between XADD and the cursor's update re-sends up to one
batch; `host` and `row` identify an entry). Redis down: rows stay in the file and are sent
when it is back (if still retained); the writer retries with a backoff and never waits on
Redis for longer than its socket timeout.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from velox.spend import rowframe
from velox.spend.rowframe import BadFrame

log = logging.getLogger("velox.ledger")

NAMED = rowframe.NAMED  # a row's label: ids into `names`, the combination an id into `labels`
COLUMNS = rowframe.COLUMNS
_LABEL_SLICE = slice(rowframe.NAMED_AT[0], rowframe.NAMED_AT[-1] + 1)
# A row as stored (after its id): rowframe.FRAME_COLUMNS, the six names as one label id.
_NARROW = rowframe.FRAME_COLUMNS
_IN_AT, _OUT_AT = _NARROW.index("input_tokens"), _NARROW.index("output_tokens")
_COST_AT = rowframe.COST_AT
Row = Sequence[Any]  # a tuple in COLUMNS order (a list once it has crossed a socket)
_WIDTH = len(COLUMNS)
# The field types of a well-formed stored row: integers, the cost an integer or None
# (unknown), the request id a string.
_LABEL_TYPES = (str,) * len(NAMED)
_ROW_TYPES = frozenset(
    tuple(str if at == len(_NARROW) - 1 else cost if at == _COST_AT else int
          for at in range(len(_NARROW)))
    for cost in (int, type(None)))

DAY_MS = 86_400_000
# The ledger keeps no index on ts_ms: `segments` hold the first id and the oldest and newest
# ts_ms of each run of rows written over about this long (purges and `velox spend --since`
# find their rows' ids there, and read at most a segment more than they need).
SEGMENT_MS = 10_000
FILE_NAME = "ledger.sqlite3"
STREAM = "velox:ledger"
# A batch is one transaction: 4,096 rows take ~10 ms to insert on this machine
# (benches/bench_ledger.py), short enough that a reader never waits long for the WAL.
BATCH_ROWS = 4096
# The writer wakes at least this often; a row waits at most this long before it is committed
# (the supervisor's share of what a SIGKILL can lose).
INTERVAL_S = 0.25
# 262,144 queued rows (~60 MB of tuples) is over ten seconds of the gateway's top rate: a
# writer that far behind is stuck, and dropping (counted) beats growing without bound.
QUEUE_MAX = 262_144
# Retention: a purge batch aims at this much time; its row count halves when a batch took
# longer and doubles (up to PURGE_ROWS_MAX) when it took under a quarter of it.
PURGE_BUDGET_S = 0.02
PURGE_ROWS_START = 2000
PURGE_ROWS_MAX = 50_000
PURGE_EVERY_S = 60.0
# spend_daily rows older than this are folded into one row per key and team ("earlier"), so
# "total" budgets keep their sum while the table stays small (keys x teams x 400 rows).
DAILY_KEEP_DAYS = 400
EARLIER = "0000-00-00"
# Redis mirror: rows sent per writer pass, and the backoff after a failure (doubling).
SHIP_ROWS = 4 * BATCH_ROWS
REDIS_TIMEOUT_S = 1.0
REDIS_BACKOFF_S = (1.0, 60.0)
DEFAULT_STREAM_MAXLEN = 1_000_000
_TELL_SKIPPED = 10

_REQUESTS = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    ts_ms INTEGER NOT NULL,
    label_id INTEGER NOT NULL,
    status INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL, cache_write_tokens INTEGER NOT NULL,
    reasoning_tokens INTEGER NOT NULL,
    cost_nanos INTEGER,
    latency_us INTEGER NOT NULL,
    request_id TEXT NOT NULL)"""
_VIEW = """
CREATE VIEW IF NOT EXISTS ledger AS
    SELECT r.id, r.ts_ms, k.name AS key, t.name AS team, ro.name AS route,
           u.name AS upstream, m.name AS model, a.name AS api, r.status,
           r.input_tokens, r.output_tokens, r.cached_tokens, r.cache_write_tokens,
           r.reasoning_tokens, r.cost_nanos, r.latency_us, r.request_id
    FROM requests r JOIN labels l ON l.id = r.label_id
    JOIN names k ON k.id = l.key_id JOIN names t ON t.id = l.team_id
    JOIN names ro ON ro.id = l.route_id JOIN names u ON u.id = l.upstream_id
    JOIN names m ON m.id = l.model_id JOIN names a ON a.id = l.api_id"""
_LABEL_IDS = "key_id, team_id, route_id, upstream_id, model_id, api_id"
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS names (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS labels (
    id INTEGER PRIMARY KEY,
    key_id INTEGER NOT NULL, team_id INTEGER NOT NULL, route_id INTEGER NOT NULL,
    upstream_id INTEGER NOT NULL, model_id INTEGER NOT NULL, api_id INTEGER NOT NULL,
    UNIQUE ({_LABEL_IDS}));
{_REQUESTS};
CREATE TABLE IF NOT EXISTS segments (
    id INTEGER PRIMARY KEY, min_ts INTEGER NOT NULL, max_ts INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS segments_min ON segments (min_ts);
CREATE INDEX IF NOT EXISTS segments_max ON segments (max_ts);
CREATE TABLE IF NOT EXISTS spend_daily (
    day TEXT NOT NULL, key_id INTEGER NOT NULL, team_id INTEGER NOT NULL,
    requests INTEGER NOT NULL, unpriced INTEGER NOT NULL, cost_nanos INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
    PRIMARY KEY (day, key_id, team_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
{_VIEW};
"""
_INSERT = (f"INSERT INTO requests ({', '.join(c + '_id' if c == 'label' else c for c in _NARROW)})"
           f" VALUES ({','.join('?' * len(_NARROW))})")
# The first row of a batch after a purge removed the newest rows: at an id of its own.
_INSERT_AT = _INSERT.replace("(ts_ms", "(id, ts_ms", 1).replace("VALUES (", "VALUES (?,", 1)
BUSY_S = 5.0  # how long a statement waits for another connection's write lock
OPEN_WAIT_S = 600  # at start-up, for another process's conversion of an older file
LAST_ID = "last_id"  # meta: the largest id ever given, kept when its row was purged
_CURSORS = "stream_cursor:"  # meta: the Redis mirror's cursor per stream (StreamMirror)
_ADD_LABEL = (f"INSERT INTO labels ({_LABEL_IDS}) VALUES (?,?,?,?,?,?) ON CONFLICT "
              f"({_LABEL_IDS}) DO UPDATE SET key_id = key_id RETURNING id")
_SUM_DAILY = (
    " ON CONFLICT (day, key_id, team_id) DO UPDATE SET requests = requests + "
    "excluded.requests, unpriced = unpriced + excluded.unpriced, cost_nanos = cost_nanos + "
    "excluded.cost_nanos, input_tokens = input_tokens + excluded.input_tokens, "
    "output_tokens = output_tokens + excluded.output_tokens")
_ADD_DAILY = "INSERT INTO spend_daily VALUES (?,?,?,?,?,?,?,?)" + _SUM_DAILY


def make_row(*, ts_ms: int, key: str = "", team: str = "", route: str = "",
             upstream: str = "", model: str = "", api: str = "chat", status: int = 200,
             input_tokens: int = 0, output_tokens: int = 0, cached_tokens: int = 0,
             cache_write_tokens: int = 0, reasoning_tokens: int = 0,
             cost_nanos: int | None = None, latency_us: int = 0,
             request_id: str = "") -> tuple[Any, ...]:
    """A row in COLUMNS order, by name (the hot path may build the tuple directly)."""
    return (ts_ms, key, team, route, upstream, model, api, status, input_tokens,
            output_tokens, cached_tokens, cache_write_tokens, reasoning_tokens, cost_nanos,
            latency_us, request_id)


def ledger_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / FILE_NAME


def utc_day(ts_ms: int) -> str:
    return dt.datetime.fromtimestamp(ts_ms / 1000, dt.UTC).strftime("%Y-%m-%d")


def connect(path: str | Path, readonly: bool = False) -> sqlite3.Connection:
    """A connection in WAL mode (the writer's), or a read-only one (reports, /spend)."""
    if readonly:
        conn = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True, timeout=5.0,
                               check_same_thread=False)
        conn.execute("PRAGMA query_only = ON")
        return conn
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, timeout=BUSY_S, isolation_level=None, check_same_thread=False)
    try:
        _prepare(conn)
    except sqlite3.OperationalError as exc:
        if "locked" not in str(exc):
            raise
        # Another process holds the file's write lock past BUSY_S: a gateway sharing this
        # state directory converting an older, large file in one transaction (about 2 s per
        # million rows here), or a long write by hand. Say so and wait for it instead of
        # dying at start-up with a traceback.
        log.warning("ledger %s is locked by another process (converting an older file?): "
                    "waiting up to %d s", path, OPEN_WAIT_S)
        conn.execute(f"PRAGMA busy_timeout = {OPEN_WAIT_S * 1000}")
        try:
            _prepare(conn)
        except sqlite3.OperationalError as again:
            conn.close()
            raise OSError(f"ledger {path}: still locked by another process after "
                          f"{OPEN_WAIT_S} s ({again}); is another gateway using this "
                          "VELOX_STATE_DIR?") from again
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_S * 1000)}")
    return conn


def _prepare(conn: sqlite3.Connection) -> None:
    """WAL, the schema and any conversion of an older file; each step is idempotent, so a
    second try after a lock wait repeats only what did not happen."""
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    # The WAL is truncated back to 64 MiB after a checkpoint, not left at its peak size.
    conn.execute("PRAGMA journal_size_limit = 67108864")
    conn.executescript(_SCHEMA)
    conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema', '2')")
    if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'requests_ts'").fetchone():
        _segments_from_index(conn)
    if "key_id" in {c[1] for c in conn.execute("PRAGMA table_info(requests)")}:
        _labels_from_columns(conn)
    # A new file, or one from before the high-water mark (a no-op once it has one).
    conn.execute(f"INSERT OR IGNORE INTO meta SELECT '{LAST_ID}', MAX((SELECT COALESCE(MAX(id), "
                 f"0) FROM requests), (SELECT COALESCE(MAX(CAST(value AS INTEGER)), 0) FROM meta "
                 f"WHERE name >= '{_CURSORS}' AND name < '{_CURSORS[:-1]};'))")


def _labels_from_columns(conn: sqlite3.Connection) -> None:
    """A file with a column per name (an earlier version): its combinations become labels,
    its rows keep their ids (segments, the Redis cursor) in one transaction; a crash leaves
    the old file, converted again next time."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("DROP VIEW ledger")
        conn.execute("ALTER TABLE requests RENAME TO requests_by_name")
        conn.execute(f"INSERT OR IGNORE INTO labels ({_LABEL_IDS}) SELECT DISTINCT "
                     f"{_LABEL_IDS} FROM requests_by_name")
        conn.execute(_REQUESTS)
        stored = ", ".join(f"r.{c}" if c != "label" else "l.id" for c in _NARROW)
        conn.execute(f"INSERT INTO requests SELECT r.id, {stored} FROM requests_by_name r "
                     f"JOIN labels l USING ({_LABEL_IDS}) ORDER BY r.id")
        conn.execute("DROP TABLE requests_by_name")
        conn.execute(_VIEW)
        conn.execute("UPDATE meta SET value = '2' WHERE name = 'schema'")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def has_labels(conn: sqlite3.Connection) -> bool:
    """Whether the file stores a label id per row (False: a file of an earlier version,
    open read-only before any writer converted it)."""
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'labels'").fetchone() \
        is not None


def _segments_from_index(conn: sqlite3.Connection) -> None:
    """A file written with the time index (an earlier version): segments of 4,096 ids, then
    the index goes."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("INSERT OR REPLACE INTO segments SELECT MIN(id), MIN(ts_ms), MAX(ts_ms) "
                     "FROM requests GROUP BY id / 4096")
        conn.execute("DROP INDEX requests_ts")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def first_id(conn: sqlite3.Connection, since_ms: int) -> int:
    """An id at or below that of every row with ts_ms >= since_ms (velox spend --since); 0
    for a file without segments (read-only, not opened by a writer since it had the time
    index)."""
    try:
        found = conn.execute("SELECT MIN(id) FROM segments WHERE max_ts >= ?",
                             (since_ms,)).fetchone()[0]
    except sqlite3.OperationalError:  # no segments table
        return 0
    if found is None:  # no row is that recent
        return int(conn.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM requests").fetchone()[0])
    return int(found)


class Store:
    """The ledger file through one connection: writes (the writer thread's) and queries."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.skipped = 0
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        # Label id by its six names, and the six names' ids by label id.
        self._labels: dict[tuple[str, ...], int] = {}
        self._label_ids: dict[int, tuple[int, ...]] = {}
        self._pairs: dict[int, tuple[int, ...]] = {}  # label id: (key id, team id)
        self._load_names()
        # The largest id a purge removed with its row (LAST_ID): the next rows go after it.
        self.last_id = int(self.get_meta(LAST_ID, "0"))

    def _load_names(self) -> None:
        self._ids = {n: i for i, n in self.conn.execute("SELECT id, name FROM names")}
        self._names = {i: n for n, i in self._ids.items()}
        self._labels, self._label_ids, self._pairs = {}, {}, {}
        if has_labels(self.conn):
            for label_id, *ids in self.conn.execute(f"SELECT id, {_LABEL_IDS} FROM labels"):
                self._add_label(label_id, tuple(map(self._names.__getitem__, ids)), tuple(ids))

    def _add_label(self, label_id: int, names: tuple[Any, ...], ids: tuple[int, ...]) -> None:
        self._labels[names] = label_id
        self._label_ids[label_id] = ids
        self._pairs[label_id] = ids[:2]
        try:
            last = self.conn.execute("SELECT id, min_ts, max_ts FROM segments ORDER BY id "
                                     "DESC LIMIT 1").fetchone()
        except sqlite3.OperationalError:  # read-only, a file from before the segments
            last = None
        # The open segment (first id, min ts_ms, max ts_ms) and the max it was opened with.
        self._segment: tuple[int, int, int, int] | None = (*last, last[2]) if last else None

    # --- writing ---------------------------------------------------------------------------

    def _id(self, name: object) -> int:
        text = "" if name is None else str(name)
        found = self._ids.get(text)
        if found is None:
            found = self.conn.execute("INSERT INTO names (name) VALUES (?) ON CONFLICT (name) "
                                      "DO UPDATE SET name = name RETURNING id",
                                      (text,)).fetchone()[0]
            self._ids[text] = found
            self._names[found] = text
        return found

    def _label(self, names: tuple[Any, ...]) -> int:
        """The id of a label (six names, None as ""), added to `labels` when new."""
        found = self._labels.get(names)
        if found is None:
            texts = tuple("" if n is None else str(n) for n in names)
            ids = tuple(map(self._id, texts))
            found = self.conn.execute(_ADD_LABEL, ids).fetchone()[0]
            self._add_label(found, texts, ids)
            self._labels[names] = found
        return found

    def _encoded(self, row: Row) -> tuple[Any, ...]:
        """`row` as stored (rowframe.FRAME_COLUMNS): its six names as one label id."""
        return (row[0], self._label(tuple(row[_LABEL_SLICE])), *row[_LABEL_SLICE.stop:])

    def append(self, rows: Sequence[Row], extra: Callable[[], None] | None = None) -> int:
        """Insert `rows` and their daily totals in one transaction (plus `extra`, run inside
        it); return how many were written. A row that does not fit the schema is skipped
        and logged, never allowed to fail its whole batch."""
        return self.write([rows], extra)

    def write(self, parts: Sequence[Sequence[Row] | Columns],
              extra: Callable[[], None] | None = None) -> int:
        """`append` for several parts in one transaction: lists of rows, or a frame's
        columns (rowframe.unpack: their types are the encoding's, only names need ids)."""
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            daily = _Daily()
            written = 0
            span: list[int] = []  # the batch's min and max ts_ms
            start = conn.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM requests").fetchone()[0]
            placed = start > self.last_id  # else the first row goes after the purged ids
            start = max(start, self.last_id + 1)
            for part in parts:
                columns = (self._id_columns(part) if isinstance(part, Columns)
                           else self._row_columns(part))
                if not columns:
                    continue
                rows = zip(*columns, strict=True)
                if not placed:
                    conn.execute(_INSERT_AT, (start, *next(rows)))
                    placed = True
                conn.executemany(_INSERT, rows)
                daily.add(columns, self._pairs)
                written += len(columns[0])
                span = [min(columns[0]), max(columns[0]), *span]
            conn.executemany(_ADD_DAILY, daily.rows())
            if span:
                self._add_segment(start, min(span), max(span))
            if extra is not None:
                extra()
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            self._load_names()  # names inserted by the batch are gone with it
            raise
        return written

    def _add_segment(self, start: int, low: int, high: int) -> None:
        """Count a batch's ids (from `start`) and times into the open segment while its
        newest time stays within SEGMENT_MS of the one it opened with, else open a new one
        at `start` (segments replace an index on ts_ms, which cost ~0.5 us of a row's ~1.9 us
        insert and ~20 bytes of its ~105)."""
        open_ = self._segment
        if open_ is not None and high < open_[3] + SEGMENT_MS:
            low, high = min(low, open_[1]), max(high, open_[2])
            self.conn.execute("UPDATE segments SET min_ts = ?, max_ts = ? WHERE id = ?",
                              (low, high, open_[0]))
            self._segment = (open_[0], low, high, open_[3])
        else:
            self.conn.execute("INSERT INTO segments VALUES (?, ?, ?)", (start, low, high))
            self._segment = (start, low, high, high)

    def _id_columns(self, part: Columns) -> list[Sequence[Any]]:
        """A frame's columns as stored: its label numbers mapped to the file's label ids
        once per label (a few dozen a frame), then per row at C speed (`map`)."""
        columns = list(part.frame.columns)
        labels = part.frame.labels
        # Known labels at C speed; a frame with a new one takes the slow path for all.
        ids = dict(zip(labels, map(self._labels.get, labels.values()), strict=True))
        if None in ids.values():
            ids = dict(zip(labels, map(self._label, labels.values()), strict=True))
        columns[rowframe.LABEL_AT] = list(map(ids.__getitem__, columns[rowframe.LABEL_AT]))
        columns[_COST_AT] = list(rowframe.costs(columns[_COST_AT]))
        return columns

    def _row_columns(self, rows: Sequence[Row]) -> list[Sequence[Any]]:
        good = [r for r in (self._checked(row) for row in rows) if r is not None]
        return list(zip(*good, strict=True))

    def _checked(self, row: Row) -> tuple[Any, ...] | None:
        """`row` with its names as ids, or None (skipped and counted) when it does not fit
        the schema. Every row the gateway writes takes the first test: its fields' types
        compared as one tuple (the field-by-field check below cost ~2 us of the writer's ~4 us
        a row; it stays for the rows that fail, to name what is wrong)."""
        if len(row) == _WIDTH:
            names = tuple(row[_LABEL_SLICE])
            if tuple(map(type, names)) == _LABEL_TYPES:
                values = (row[0], self._label(names), *row[_LABEL_SLICE.stop:])
                if tuple(map(type, values)) in _ROW_TYPES:
                    return values
        return self._checked_slowly(row)

    def _checked_slowly(self, row: Row) -> tuple[Any, ...] | None:
        try:
            if len(row) != len(COLUMNS):
                raise ValueError(f"{len(row)} fields, not {len(COLUMNS)}")
            encoded = self._encoded(row)
            for at, value in enumerate(encoded):
                if at == len(_NARROW) - 1:
                    if not isinstance(value, str):
                        raise ValueError("request_id must be a string")
                elif not (isinstance(value, int) or (value is None and at == _COST_AT)):
                    raise ValueError(f"{_NARROW[at]} must be an integer")
        except (TypeError, ValueError) as exc:
            self.skipped += 1
            if self.skipped <= _TELL_SKIPPED:  # a buggy producer must not flood the log
                log.warning("ledger: a row was skipped (%s)%s", exc,
                            "; further ones are only counted" if self.skipped == _TELL_SKIPPED
                            else "")
            return None
        return encoded

    def purge(self, before_ms: int, limit: int) -> int:
        """Delete at most `limit` rows older than `before_ms` from the segment with the
        oldest rows (one transaction): a range of ids, read for their times (in a segment
        all older, every row goes; rows that came late share a segment with newer ones)."""
        conn = self.conn
        found = conn.execute("SELECT id FROM segments WHERE min_ts < ? ORDER BY min_ts "
                             "LIMIT 1", (before_ms,)).fetchone()
        if found is None:
            return 0
        start = found[0]
        end = conn.execute("SELECT COALESCE(MIN(id), 1 << 62) FROM segments WHERE id > ?",
                           (start,)).fetchone()[0]
        newest = self._newest()
        deleted: int = conn.execute(
            "DELETE FROM requests WHERE id IN (SELECT id FROM requests WHERE id >= ? AND "
            "id < ? AND ts_ms < ? ORDER BY id LIMIT ?)", (start, end, before_ms, limit)).rowcount
        if newest > self.last_id and self._newest() < newest:  # its id is not to be given again
            self.set_meta(LAST_ID, str(newest))
            # The caller's transaction; rolled back, the rows stay and this is merely ahead.
            self.last_id = newest
        if deleted < limit:  # none older left in it: its times are what remains
            self._refresh_segment(start, end)
        return deleted

    def _newest(self) -> int:
        return int(self.conn.execute("SELECT COALESCE(MAX(id), 0) FROM requests").fetchone()[0])

    def _refresh_segment(self, start: int, end: int) -> None:
        low, high = self.conn.execute("SELECT MIN(ts_ms), MAX(ts_ms) FROM requests WHERE "
                                      "id >= ? AND id < ?", (start, end)).fetchone()
        open_ = self._segment
        is_open = open_ is not None and open_[0] == start
        if low is None:  # empty: its ids are nobody's (the next batch opens a segment)
            self.conn.execute("DELETE FROM segments WHERE id = ?", (start,))
            if is_open:
                self._segment = None
            return
        self.conn.execute("UPDATE segments SET min_ts = ?, max_ts = ? WHERE id = ?",
                          (low, high, start))
        if open_ is not None and is_open:
            self._segment = (start, low, high, open_[3])

    def fold_daily(self, before_day: str) -> None:
        """Fold spend_daily rows before `before_day` into the "earlier" row of their key and
        team (one transaction)."""
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                "INSERT INTO spend_daily SELECT ?, key_id, team_id, SUM(requests), "
                "SUM(unpriced), SUM(cost_nanos), SUM(input_tokens), SUM(output_tokens) FROM "
                "spend_daily WHERE day < ? AND day != ? GROUP BY key_id, team_id" + _SUM_DAILY,
                (EARLIER, before_day, EARLIER))
            conn.execute("DELETE FROM spend_daily WHERE day < ? AND day != ?",
                         (before_day, EARLIER))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def get_meta(self, name: str, default: str = "") -> str:
        found = self.conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return default if found is None else str(found[0])

    def set_meta(self, name: str, value: str) -> None:
        self.conn.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET "
                          "value = excluded.value", (name, value))

    # --- reading ---------------------------------------------------------------------------

    def name(self, name_id: int) -> str:
        found = self._names.get(name_id)
        if found is None:  # written by another connection since this one loaded the names
            self._names.update((i, n) for i, n in self.conn.execute(
                "SELECT id, name FROM names WHERE id >= ?", (name_id,)))
            found = self._names.get(name_id, "")
        return found

    def rows_after(self, row_id: int, limit: int) -> list[tuple[Any, ...]]:
        """(id, *row) for rows with id > `row_id`, names decoded (for the Redis mirror)."""
        out = []
        labels: dict[int, tuple[str, ...]] = {}
        for row_id_, ts, label_id, *rest in self.conn.execute(
                "SELECT * FROM requests WHERE id > ? ORDER BY id LIMIT ?", (row_id, limit)):
            names = labels.get(label_id)
            if names is None:
                names = labels[label_id] = tuple(map(self.name, self.label_ids(label_id)))
            out.append((row_id_, ts, *names, *rest))
        return out

    def label_ids(self, label_id: int) -> tuple[int, ...]:
        """The six name ids of a label (loaded again when another connection added it)."""
        found = self._label_ids.get(label_id)
        if found is None:
            self._load_names()
            found = self._label_ids[label_id]
        return found

    def spent(self, by: str = "key", since_day: str = EARLIER) -> dict[str, Spent]:
        """The durable totals per key (or team) from `since_day` on (UTC, inclusive; the
        default covers everything ever written): what a budget resumes from."""
        column = {"key": "key_id", "team": "team_id"}[by]
        out = {}
        for name_id, requests, unpriced, cost in self.conn.execute(
                f"SELECT {column}, SUM(requests), SUM(unpriced), SUM(cost_nanos) FROM "
                f"spend_daily WHERE day >= ? GROUP BY {column}", (since_day,)):
            out[self.name(name_id)] = Spent(requests, unpriced, cost)
        return out


@dataclass(frozen=True, slots=True)
class Spent:
    requests: int
    unpriced: int  # requests whose model had no price (cost unknown, not in cost_nanos)
    cost_nanos: int


class _Daily:
    """A transaction's spend per (UTC day, key, team), for the upsert into spend_daily."""

    def __init__(self) -> None:
        # Per day: per (key id, team id): requests, unpriced, cost, input and output tokens.
        self.days: dict[str, dict[tuple[int, ...], list[int]]] = {}

    def add(self, columns: list[Sequence[Any]], pairs: dict[int, tuple[int, ...]]) -> None:
        """Sum stored columns; `pairs`: a label id's (key id, team id), one tuple a label."""
        columns = [*columns]
        columns[rowframe.LABEL_AT] = list(map(pairs.__getitem__, columns[rowframe.LABEL_AT]))
        ts = columns[0]
        first = min(ts) // DAY_MS
        if max(ts) // DAY_MS != first:  # a batch across midnight (UTC): row by row
            for at, day_ms in enumerate(ts):
                self._add(day_ms // DAY_MS, [c[at:at + 1] for c in columns])
            return
        self._add(first, columns)

    def _add(self, day_number: int, columns: list[Sequence[Any]]) -> None:
        sums = self.days.setdefault(utc_day(day_number * DAY_MS), {})
        get = sums.get
        for pair, cost, inp, out in zip(
                columns[rowframe.LABEL_AT], columns[_COST_AT], columns[_IN_AT],
                columns[_OUT_AT], strict=True):
            acc = get(pair)
            if acc is None:
                acc = sums[pair] = [0, 0, 0, 0, 0]
            acc[0] += 1
            if cost is None:
                acc[1] += 1
            else:
                acc[2] += cost
            acc[3] += inp
            acc[4] += out

    def rows(self) -> list[tuple[Any, ...]]:
        return [(day, *pair, *sums) for day, by_pair in self.days.items()
                for pair, sums in by_pair.items()]


class Columns:
    """A worker's frame, decoded (rowframe.unpack), waiting in the writer's queue."""

    __slots__ = ("frame", "rows")

    def __init__(self, body: bytes) -> None:
        self.frame = rowframe.unpack(body)
        self.rows = len(self.frame.columns[0])


def period_start(period: str, now_ms: int) -> str:
    """The first UTC day of the budget period containing `now_ms`: `day`, `week` (ISO,
    Monday), `month`, or `total` (everything: EARLIER)."""
    today = dt.datetime.fromtimestamp(now_ms / 1000, dt.UTC).date()
    if period == "day":
        start = today
    elif period == "week":
        start = today - dt.timedelta(days=today.weekday())
    elif period == "month":
        start = today.replace(day=1)
    elif period == "total":
        return EARLIER
    else:
        raise ValueError(f"unknown budget period {period!r}: day, week, month or total")
    return start.isoformat()


class LedgerWriter:
    """The writer thread: a bounded queue drained in batches, one transaction per batch,
    retention purged in small time-bounded batches, rows mirrored to Redis when asked."""

    def __init__(self, path: str | Path, retention_days: int = 90, *, redis_url: str = "",
                 stream: str = STREAM, stream_maxlen: int = DEFAULT_STREAM_MAXLEN,
                 host: str = "", interval_s: float = INTERVAL_S, batch_rows: int = BATCH_ROWS,
                 queue_max: int = QUEUE_MAX, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.retention_ms = retention_days * 86_400_000
        self.interval_s = interval_s
        self.batch_rows = batch_rows
        self.queue_max = queue_max
        self.clock = clock
        self.host = host or socket.gethostname()
        self.mirror = (StreamMirror(redis_url, stream, stream_maxlen, self.host)
                       if redis_url else None)
        self.store: Store | None = None
        # Lists of rows (submit) and frames (submit_frame), `_queued` rows in all.
        self._queue: list[Sequence[Row] | Columns] = []
        self._queued = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.purge_rows = PURGE_ROWS_START
        self._next_purge = 0.0
        self.counts = {"written": 0, "dropped": 0, "skipped": 0, "failed": 0, "batches": 0,
                       "bad_frames": 0, "purged": 0, "purge_batches": 0, "purge_max_s": 0.0}

    def open(self) -> None:
        """Create the directory, the file and its schema now, so a bad VELOX_STATE_DIR
        fails start-up rather than a thread later."""
        self.store = Store(connect(self.path))

    def start(self) -> None:
        if self.store is None:
            self.open()
        self._thread = threading.Thread(target=self._run, name="velox-ledger", daemon=True)
        self._thread.start()

    def submit(self, rows: Sequence[Row]) -> int:
        """Queue rows for the next batch (any thread); return how many were accepted. Past
        `queue_max` queued rows the rest are dropped and counted."""
        with self._lock:
            room = self.queue_max - self._queued
            taken = rows if len(rows) <= room else rows[:max(room, 0)]
            self._queue.append(taken)
            self._queued += len(taken)
            self.counts["dropped"] += len(rows) - len(taken)
            ready = self._queued >= self.batch_rows
        if ready:
            self._wake.set()
        return len(taken)

    def submit_frame(self, body: bytes) -> int:
        """Queue a worker's frame of rows (velox.spend.rowframe; any thread): all of it, or
        none when the queue is full or the frame is not one (both counted)."""
        try:
            part = Columns(body)
        except BadFrame as exc:
            with self._lock:
                self.counts["bad_frames"] += 1
                tell = self.counts["bad_frames"] <= _TELL_SKIPPED
            if tell:  # a buggy producer must not flood the log
                log.warning("ledger: a frame of rows was dropped (%s)", exc)
            return 0
        with self._lock:
            if self._queued + part.rows > self.queue_max:
                self.counts["dropped"] += part.rows
                return 0
            self._queue.append(part)
            self._queued += part.rows
            ready = self._queued >= self.batch_rows
        if ready:
            self._wake.set()
        return part.rows

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued and stop (the supervisor calls this after its workers)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.store is not None and (self._thread is None or not self._thread.is_alive()):
            self.store.conn.close()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            queued = self._queued
        out: dict[str, Any] = {**self.counts, "queued": queued, "path": str(self.path)}
        if self.mirror is not None:
            out["redis"] = self.mirror.stats()
        return out

    # --- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self._guarded(self._drain)
            self._guarded(self._housekeep)
        self._guarded(self._drain)
        if self.mirror is not None:
            self._guarded(self._ship)

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception:
            log.exception("ledger writer: %s failed", step.__name__.strip("_"))

    def _drain(self) -> None:
        with self._lock:
            parts, self._queue, self._queued = self._queue, [], 0
        for batch, rows in self._batches(parts):
            try:
                written = self._store().write(batch)
            except sqlite3.Error:
                self.counts["failed"] += rows
                raise
            self.counts["written"] += written
            self.counts["skipped"] += rows - written
            self.counts["batches"] += 1
            if self.mirror is not None:
                self._ship()

    def _batches(self, parts: list[Sequence[Row] | Columns]
                 ) -> Iterator[tuple[list[Sequence[Row] | Columns], int]]:
        """The queued parts as transactions of about `batch_rows` rows (a frame is never
        split: a worker's frame is at most a FLUSH_S of its requests) and their row counts."""
        batch: list[Sequence[Row] | Columns] = []
        count = 0
        for part in parts:
            pieces = ([part] if isinstance(part, Columns) else
                      [part[at:at + self.batch_rows] for at in range(0, len(part),
                                                                     self.batch_rows)])
            for piece in pieces:
                size = piece.rows if isinstance(piece, Columns) else len(piece)
                if batch and count + size > self.batch_rows:
                    yield batch, count
                    batch, count = [], 0
                batch.append(piece)
                count += size
        if batch:
            yield batch, count

    def _store(self) -> Store:
        assert self.store is not None
        return self.store

    def _housekeep(self) -> None:
        now = self.clock()
        if now >= self._next_purge:
            more = self.purge_step(now)
            self._next_purge = now if more else now + PURGE_EVERY_S
        if self.mirror is not None:
            self._ship()

    def purge_step(self, now: float) -> bool:
        """One purge batch (and the daily fold once a run is over); True while more rows are
        due, so the next pass comes back after the queued rows are written."""
        store = self.store
        assert store is not None
        before = int(now * 1000) - self.retention_ms
        started = time.perf_counter()
        store.conn.execute("BEGIN IMMEDIATE")
        try:
            deleted = store.purge(before, self.purge_rows)
            store.conn.execute("COMMIT")
        except BaseException:
            store.conn.execute("ROLLBACK")
            raise
        took = time.perf_counter() - started
        self.counts["purged"] += deleted
        self.counts["purge_batches"] += deleted > 0
        self.counts["purge_max_s"] = max(self.counts["purge_max_s"], took)
        if took > PURGE_BUDGET_S:
            self.purge_rows = max(self.purge_rows // 2, 100)
        elif took < PURGE_BUDGET_S / 4:
            self.purge_rows = min(self.purge_rows * 2, PURGE_ROWS_MAX)
        if deleted == 0:
            keep_from = utc_day(int(now * 1000) - DAILY_KEEP_DAYS * 86_400_000)
            store.fold_daily(keep_from)
            return False
        return True

    def _ship(self) -> None:
        mirror, store = self.mirror, self.store
        assert mirror is not None and store is not None
        mirror.ship(store, self.clock())


class StreamMirror:
    """Rows past a cursor (kept in the ledger's meta table) to a capped Redis Stream."""

    def __init__(self, url: str, stream: str, maxlen: int, host: str) -> None:
        self.url = url
        self.stream = stream
        self.maxlen = maxlen
        self.host = host
        self.client: Any = None
        self.sent = 0
        self.errors = 0
        self.retry_at = 0.0
        self.backoff = REDIS_BACKOFF_S[0]
        self.down_since: float | None = None

    def stats(self) -> dict[str, Any]:
        return {"sent": self.sent, "errors": self.errors, "up": self.down_since is None}

    def ship(self, store: Store, now: float) -> None:
        if now < self.retry_at:
            return
        cursor_name = f"stream_cursor:{self.stream}"
        cursor = int(store.get_meta(cursor_name, "0"))
        rows = store.rows_after(cursor, SHIP_ROWS)
        if not rows:
            return
        try:
            self._send(rows)
        except Exception as exc:
            self._failed(now, exc)
            return
        store.set_meta(cursor_name, str(rows[-1][0]))
        self.sent += len(rows)
        if self.down_since is not None:
            log.info("ledger: Redis Stream %s reachable again; rows are being sent",
                     self.stream)
        self.down_since, self.backoff = None, REDIS_BACKOFF_S[0]

    def _send(self, rows: list[tuple[Any, ...]]) -> None:
        if self.client is None:
            import redis

            self.client = redis.Redis.from_url(self.url, socket_timeout=REDIS_TIMEOUT_S,
                                               socket_connect_timeout=REDIS_TIMEOUT_S)
        pipe = self.client.pipeline(transaction=False)
        for row in rows:
            fields = {"host": self.host, "row": row[0]}
            fields.update((c, v) for c, v in zip(COLUMNS, row[1:], strict=True)
                          if v is not None)
            pipe.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
        pipe.execute()

    def _failed(self, now: float, exc: Exception) -> None:
        self.errors += 1
        if self.down_since is None:
            self.down_since = now
            log.warning("ledger: cannot send rows to the Redis Stream %s (%s); they stay in "
                        "the ledger file and are sent when Redis answers again", self.stream,
                        type(exc).__name__)
        self.retry_at = now + self.backoff
        self.backoff = min(self.backoff * 2, REDIS_BACKOFF_S[1])
        self.client = None  # a fresh connection next time


def state_file(state_dir: str) -> Path | None:
    """The ledger file for VELOX_STATE_DIR, or None when the ledger is off."""
    if not state_dir or state_dir == "off":
        return None
    return ledger_path(os.path.expanduser(state_dir))
