"""Ledger rows between a worker and the supervisor: one binary frame per flush, by column.

Why not JSON: decoding a 16-field list per row made the supervisor build 16 objects a row and
then check their types one by one (~3 us a row of its ~5 us; benches/bench_ledger.py). Here
the worker transposes its batch once (`zip`, C speed) and writes

    b"L" | rows: u32 | nine int64 columns | the text columns, UTF-8, NUL-separated

The int64 columns (`INT_COLUMNS`, native byte order: both ends are the same host) are read back
with `array.frombytes` and never checked field by field: their type is guaranteed by the
encoding, and a row that did not fit it (a None token count, a float, a 17th field) was
refused by the worker when it packed (`pack` skips it and counts it). The text columns (the
six names and the request id, `TEXT_COLUMNS`) are one string: `split("\0")` gives them back,
and its count (7 x rows) is the frame's only check. A frame is self-contained: nothing carries
over from one frame to the next, so a dropped frame, a restarted worker or a reloaded
configuration never leaves the two ends disagreeing.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from itertools import chain
from typing import Any

# Column order of a row (what `Spend.row` builds and `LedgerFeed.add` takes).
COLUMNS = ("ts_ms", "key", "team", "route", "upstream", "model", "api", "status",
           "input_tokens", "output_tokens", "cached_tokens", "cache_write_tokens",
           "reasoning_tokens", "cost_nanos", "latency_us", "request_id")
WIDTH = len(COLUMNS)
COST_AT = COLUMNS.index("cost_nanos")
NAMED_AT = tuple(COLUMNS.index(c) for c in ("key", "team", "route", "upstream", "model", "api"))
TEXT_AT = (*NAMED_AT, COLUMNS.index("request_id"))
INT_AT = tuple(at for at in range(WIDTH) if at not in TEXT_AT)
TAG = b"L"  # a control frame's body that is not JSON (JSON bodies start with "{")
_HEAD = struct.Struct("=cI")
# An unknown cost (the model has no price) travels as the one int64 no cost can be.
NO_COST = -(1 << 63)
_TO_WIRE = {None: NO_COST}
_FROM_WIRE = {NO_COST: None}
_SEP = "\0"


class BadFrame(ValueError):
    """The bytes are not a ledger frame (truncated, or their counts disagree)."""


def _ints(column: Sequence[Any], at: int) -> bytes:
    if at == COST_AT:
        return array("q", map(_TO_WIRE.get, column, column)).tobytes()
    return array("q", column).tobytes()


def _text(columns: list[tuple[Any, ...]], rows: int) -> str:
    text = _SEP.join(chain.from_iterable(columns[at] for at in TEXT_AT))
    if text.count(_SEP) != len(TEXT_AT) * rows - 1:  # a NUL inside a name: never from HTTP
        text = _SEP.join(str(v).replace(_SEP, "\ufffd")
                         for v in chain.from_iterable(columns[at] for at in TEXT_AT))
    return text


def pack(rows: Sequence[Sequence[Any]]) -> tuple[bytes, int]:
    """(the frame's body, how many rows did not fit and were left out)."""
    try:
        return _pack(rows), 0
    except (TypeError, ValueError, OverflowError):
        good = [row for row in rows if _packs(row)]
        return (_pack(good) if good else b""), len(rows) - len(good)


def _pack(rows: Sequence[Sequence[Any]]) -> bytes:
    columns = list(zip(*rows, strict=True))  # ValueError: rows of different lengths
    if len(columns) != WIDTH:
        raise ValueError(f"rows of {len(columns)} fields, not {WIDTH}")
    body = [_HEAD.pack(TAG, len(rows))]
    body.extend(_ints(columns[at], at) for at in INT_AT)
    body.append(_text(columns, len(rows)).encode("utf-8", "surrogatepass"))
    return b"".join(body)


def _packs(row: Sequence[Any]) -> bool:
    try:
        _pack((row,))
    except (TypeError, ValueError, OverflowError):
        return False
    return True


def unpack(body: bytes) -> list[Sequence[Any]]:
    """The frame's columns in COLUMNS order (int64 arrays, lists of str; an unknown cost is
    NO_COST: `costs` maps it back to None), or BadFrame."""
    if len(body) < _HEAD.size or body[:1] != TAG:
        raise BadFrame("not a ledger frame")
    _, rows = _HEAD.unpack_from(body)
    view = memoryview(body)
    out: list[Sequence[Any]] = [()] * WIDTH
    at_byte = _HEAD.size
    size = 8 * rows
    if len(body) < at_byte + size * len(INT_AT):
        raise BadFrame(f"a frame of {rows} rows is truncated")
    for at in INT_AT:
        column = array("q")
        column.frombytes(view[at_byte:at_byte + size])
        out[at] = column
        at_byte += size
    try:
        text = str(view[at_byte:], "utf-8", "surrogatepass").split(_SEP)
    except UnicodeDecodeError as exc:
        raise BadFrame(f"names are not UTF-8 ({exc.reason})") from None
    if len(text) != len(TEXT_AT) * rows:
        raise BadFrame(f"{len(text)} names and ids for {rows} rows")
    for n, at in enumerate(TEXT_AT):
        out[at] = text[n * rows:(n + 1) * rows]
    return out


def rows_of(columns: list[Sequence[Any]]) -> list[tuple[Any, ...]]:
    """The rows back from `unpack`'s columns (tests and tools; the writer keeps columns)."""
    cost = columns[COST_AT]
    fixed = [*columns[:COST_AT], list(map(_FROM_WIRE.get, cost, cost)),
             *columns[COST_AT + 1:]]
    return list(zip(*fixed, strict=True))


def costs(column: Sequence[int]) -> Any:
    """The cost column with None back for an unknown cost."""
    return map(_FROM_WIRE.get, column, column)
