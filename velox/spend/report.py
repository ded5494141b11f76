"""Totals over a period, from the ledger: `velox spend` and the admin server's /spend.

`totals(conn, since_ms, until_ms, by)` groups the rows of [since, until) by key, team, model,
upstream, route, api or day (UTC) and returns, per group, the grouping field, `requests`,
`input_tokens`, `output_tokens`, `cost_usd` and `unpriced_requests`: the requests whose model
had no price, whose cost is unknown and therefore not in `cost_usd` (a group made only of
such requests has `cost_usd` null, never 0). Groups come most expensive first.

A period is `--since 7d` (also `h`, `m` for minutes, `w`, or a UTC date `2026-11-01`), until
now unless `--until` says otherwise.

The local file holds this host's rows. With VELOX_REDIS_URL, `from_stream` reads the Redis
Stream every host writes into an in-memory SQLite file of the same schema, so the same query
answers for all hosts (as far back as the stream's cap keeps).
"""

from __future__ import annotations

import datetime as dt
import re
import sqlite3
from typing import Any

from velox.spend.ledger import COLUMNS, STREAM, Store, connect, first_id, has_labels, state_file
from velox.spend.text import aligned

GROUPS = ("key", "team", "model", "upstream", "route", "api", "day")
FIELDS = ("requests", "input_tokens", "output_tokens", "cost_usd", "unpriced_requests")
_UNITS_S = {"m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}
_SPAN = re.compile(r"(\d{1,6})([mhdw])")
_DAY_SQL = "strftime('%Y-%m-%d', ts_ms / 1000, 'unixepoch')"
# Rows the stream reader loads at most (an in-memory copy: ~100 bytes a row).
STREAM_READ_MAX = 5_000_000
_STREAM_PAGE = 10_000
# Host clocks and Redis's may differ: entries are read from this long before `since`.
_CLOCK_SLACK_MS = 300_000


class BadQuery(ValueError):
    """A period or grouping the report cannot use (the message says what it takes)."""


def parse_time(text: str, now_ms: int, name: str = "since") -> int:
    """`7d`, `24h`, `30m`, `2w` before now, or a UTC date / ISO time, as epoch ms."""
    value = text.strip()
    span = _SPAN.fullmatch(value)
    if span:
        return now_ms - int(span.group(1)) * _UNITS_S[span.group(2)] * 1000
    try:
        moment = dt.datetime.fromisoformat(value)
    except ValueError:
        raise BadQuery(f"{name}={text!r}: expected a span like 7d, 24h, 30m, 2w or a UTC date "
                       "like 2026-11-01") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return int(moment.timestamp() * 1000)


def check_group(by: str) -> str:
    if by not in GROUPS:
        raise BadQuery(f"by={by!r}: expected one of {', '.join(GROUPS)}")
    return by


def totals(conn: sqlite3.Connection, since_ms: int, until_ms: int,
           by: str) -> list[dict[str, Any]]:
    """Per group of `by`: requests, tokens and cost over [since_ms, until_ms)."""
    check_group(by)
    expr = _DAY_SQL if by == "day" else f"{by}_id"
    # A row's names are its label's (a file of an earlier version, not yet converted by a
    # writer, has them in the row).
    source = ("requests JOIN labels ON labels.id = requests.label_id"
              if by != "day" and has_labels(conn)
              else "requests")
    rows = conn.execute(
        f"SELECT {expr} AS g, COUNT(*), SUM(input_tokens), SUM(output_tokens), "
        f"SUM(cost_nanos), SUM(cost_nanos IS NULL) FROM {source} "
        f"WHERE requests.id >= ? AND ts_ms >= ? AND ts_ms < ? GROUP BY g",
        (first_id(conn, since_ms), since_ms, until_ms)).fetchall()
    store = Store(conn) if by != "day" else None
    out = []
    for group, requests, tokens_in, tokens_out, nanos, unpriced in rows:
        name = group if store is None else store.name(group)
        out.append({by: name, "requests": requests, "input_tokens": tokens_in,
                    "output_tokens": tokens_out,
                    "cost_usd": None if nanos is None else round(nanos / 1e9, 9),
                    "unpriced_requests": unpriced})
    out.sort(key=lambda r: (-(r["cost_usd"] or 0.0), str(r[by])))
    return out


def format_totals(rows: list[dict[str, Any]], by: str, header: str) -> str:
    """The table `velox spend` prints (cost "-": unknown, the model had no price)."""
    columns = (by, *FIELDS)
    body = [[r[c] for c in columns] for r in rows]
    if rows:
        known = [r["cost_usd"] for r in rows if r["cost_usd"] is not None]
        body.append(["total", *(sum(r[c] for r in rows) for c in FIELDS[:3]),
                     round(sum(known), 9) if known else None,
                     sum(r["unpriced_requests"] for r in rows)])
    return header + "\n" + aligned(columns, body, right=frozenset(FIELDS))


def from_stream(redis_url: str, since_ms: int, stream: str = STREAM) -> sqlite3.Connection:
    """The rows every host sent to the Redis Stream since `since_ms`, in an in-memory ledger
    (each (host, row) once: the mirror is at-least-once)."""
    import redis

    client: Any = redis.Redis.from_url(redis_url, socket_timeout=10)
    conn = connect(":memory:")
    store = Store(conn)
    seen: set[tuple[bytes, bytes]] = set()
    start = f"{max(since_ms - _CLOCK_SLACK_MS, 0)}-0"
    batch: list[tuple[Any, ...]] = []
    loaded = 0
    while loaded < STREAM_READ_MAX:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(
            stream, min=start, max="+", count=_STREAM_PAGE)
        if not entries:
            break
        for _entry_id, fields in entries:
            ident = (fields.get(b"host", b""), fields.get(b"row", b""))
            if ident in seen:
                continue
            seen.add(ident)
            batch.append(_row_of(fields))
        loaded += len(entries)
        start = "(" + entries[-1][0].decode()
        if len(batch) >= _STREAM_PAGE:
            store.append(batch)
            batch = []
    store.append(batch)
    client.close()
    return conn


def _row_of(fields: dict[bytes, bytes]) -> tuple[Any, ...]:
    values: list[Any] = []
    for column in COLUMNS:
        raw = fields.get(column.encode())
        if column in ("key", "team", "route", "upstream", "model", "api", "request_id"):
            values.append("" if raw is None else raw.decode("utf-8", "replace"))
        else:
            values.append(None if raw is None else int(raw))
    return tuple(values)


class NoLedger(LookupError):
    """The ledger is off (VELOX_STATE_DIR=off)."""


def local_totals(state_dir: str, since: str, until: str | None, by: str,
                 now_ms: int) -> list[dict[str, Any]]:
    """`totals` over this host's ledger file for the textual period (CLI and /spend): no
    file yet is no rows; BadQuery for a bad period or grouping, NoLedger when it is off."""
    since_ms = parse_time(since, now_ms)
    until_ms = now_ms + 1 if until is None else parse_time(until, now_ms, "until")
    check_group(by)
    path = state_file(state_dir)
    if path is None:
        raise NoLedger("the ledger is off (VELOX_STATE_DIR=off)")
    if not path.exists():
        return []
    conn = connect(path, readonly=True)
    try:
        return totals(conn, since_ms, until_ms, by)
    finally:
        conn.close()
