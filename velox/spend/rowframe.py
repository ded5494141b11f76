"""Ledger rows between a worker and the supervisor: one binary frame per flush, by column.

Why not JSON: decoding a 16-field list per row made the supervisor build 16 objects a row and
then check their types one by one (~3 us a row of its ~5 us; benches/bench_ledger.py). Here
the worker transposes its batch once (`zip`, C speed), gives each distinct combination of the
six names (key, team, route, upstream, model, api: a `label`) a number within the frame (the
row where it first appears), and writes

    b"M" | rows: u32 | labels: u32 | ten int64 columns | the labels' names (in the order of
    their numbers) and the request ids, UTF-8, NUL-separated

The int64 columns (`INT_COLUMNS`, native byte order: both ends are the same host) are read back
with `array.frombytes` and never checked field by field: their type is guaranteed by the
encoding, and a row that did not fit it (a None token count, a float, a 17th field) was
refused by the worker when it packed (`pack` skips it and counts it). A frame of 1,000 rows
has a few dozen labels (keys x targets in use), so the text is mostly the request ids, and the
supervisor maps a label to its row in the file once a frame, not six names a row. The text's
count (6 x labels + rows) is the frame's only check. A frame is self-contained: nothing carries
over from one frame to the next, so a dropped frame, a restarted worker or a reloaded
configuration never leaves the two ends disagreeing.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from itertools import chain, count
from typing import Any, NamedTuple

# Column order of a row (what `Spend.row` builds and `LedgerFeed.add` takes).
COLUMNS = ("ts_ms", "key", "team", "route", "upstream", "model", "api", "status",
           "input_tokens", "output_tokens", "cached_tokens", "cache_write_tokens",
           "reasoning_tokens", "cost_nanos", "latency_us", "request_id")
WIDTH = len(COLUMNS)
NAMED = ("key", "team", "route", "upstream", "model", "api")  # a row's label
NAMED_AT = tuple(COLUMNS.index(c) for c in NAMED)
# A frame's columns: the row's with its six names as one label number (the `requests` table
# of velox.spend.ledger has the same order after its id).
FRAME_COLUMNS = ("ts_ms", "label", *(c for c in COLUMNS if c not in NAMED and c != "ts_ms"))
_COUNTS_IN_ROW = tuple(range(COLUMNS.index("status"), COLUMNS.index("cost_nanos")))
_COST_IN_ROW, _LATENCY_IN_ROW = COLUMNS.index("cost_nanos"), COLUMNS.index("latency_us")
LABEL_AT = FRAME_COLUMNS.index("label")
COST_AT = FRAME_COLUMNS.index("cost_nanos")
REQUEST_ID_AT = FRAME_COLUMNS.index("request_id")
INT_COLUMNS = FRAME_COLUMNS[:REQUEST_ID_AT]
TAG = b"M"  # a control frame's body that is not JSON (JSON bodies start with "{")
_HEAD = struct.Struct("=cII")
# An unknown cost (the model has no price) travels as the one int64 no cost can be.
NO_COST = -(1 << 63)
_TO_WIRE = {None: NO_COST}
_FROM_WIRE = {NO_COST: None}
_SEP = "\0"


class BadFrame(ValueError):
    """The bytes are not a ledger frame (truncated, or their counts disagree)."""


class Frame(NamedTuple):
    """A decoded frame: its labels (six names each, by number) and its columns in
    FRAME_COLUMNS order (int64 arrays, the request ids a list of str; the label column holds
    the numbers)."""

    labels: dict[int, tuple[str, ...]]
    columns: list[Sequence[Any]]


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
    # A label's number is the row where it first appears: one hash of each row's six names,
    # at C speed (a frame may hold as many labels as rows: 200 keys x 12 models). The
    # labels' names go in that order, which the reader recovers by sorting the numbers.
    index: dict[tuple[Any, ...], int] = {}
    labels = zip(*(columns[at] for at in NAMED_AT), strict=True)
    numbers = array("q", map(index.setdefault, labels, count()))
    cost = columns[_COST_IN_ROW]
    ints: list[Any] = [columns[0], numbers,
                       *(columns[at] for at in _COUNTS_IN_ROW), map(_TO_WIRE.get, cost, cost),
                       columns[_LATENCY_IN_ROW]]
    body = [_HEAD.pack(TAG, len(rows), len(index))]
    body.extend(array("q", column).tobytes() for column in ints)
    texts = chain(chain.from_iterable(index), columns[-1])
    body.append(_text(texts, 6 * len(index) + len(rows)).encode("utf-8", "surrogatepass"))
    return b"".join(body)


def pack_columns(rows: int, ints: bytes, names: Sequence[Sequence[str]], ids: bytes) -> bytes:
    """A frame of rows kept by column (velox.spend.book: `take`'s rows, INT_COLUMNS as one
    bytes, the request ids as UTF-8 joined by NUL), given its labels' six names each in the
    order of their numbers."""
    text = _text(chain.from_iterable(names), 6 * len(names)).encode("utf-8", "surrogatepass")
    return b"".join((_HEAD.pack(TAG, rows, len(names)), ints, text, b"\0", ids))


def _text(values: Any, count: int) -> str:
    values = list(values)
    text = _SEP.join(values)  # TypeError: a name or id that is not text
    if text.count(_SEP) != count - 1:  # a NUL inside a name: never from HTTP
        text = _SEP.join(v.replace(_SEP, "\ufffd") for v in values)
    return text


def _packs(row: Sequence[Any]) -> bool:
    try:
        _pack((row,))
    except (TypeError, ValueError, OverflowError):
        return False
    return True


def unpack(body: bytes) -> Frame:
    """The frame's labels and columns (an unknown cost is NO_COST: `costs` maps it back to
    None), or BadFrame."""
    if len(body) < _HEAD.size or body[:1] != TAG:
        raise BadFrame("not a ledger frame")
    _, rows, labels = _HEAD.unpack_from(body)
    view = memoryview(body)
    out: list[Sequence[Any]] = []
    at_byte = _HEAD.size
    size = 8 * rows
    if len(body) < at_byte + size * len(INT_COLUMNS):
        raise BadFrame(f"a frame of {rows} rows is truncated")
    for _ in INT_COLUMNS:
        column = array("q")
        column.frombytes(view[at_byte:at_byte + size])
        out.append(column)
        at_byte += size
    try:
        text = str(view[at_byte:], "utf-8", "surrogatepass").split(_SEP)
    except UnicodeDecodeError as exc:
        raise BadFrame(f"names are not UTF-8 ({exc.reason})") from None
    names = 6 * labels
    if len(text) != names + rows:
        raise BadFrame(f"{len(text)} names and ids for {rows} rows of {labels} labels")
    numbers = sorted(set(out[LABEL_AT]))
    if len(numbers) != labels or (numbers and (numbers[0] < 0 or numbers[-1] >= rows)):
        raise BadFrame(f"label numbers disagree with the frame's {labels} labels")
    out.append(text[names:])
    names_of = zip(*[iter(text[:names])] * 6, strict=True)
    return Frame(dict(zip(numbers, names_of, strict=True)), out)


def rows_of(frame: Frame) -> list[tuple[Any, ...]]:
    """The rows back in COLUMNS order from `unpack` (tests and tools; the writer keeps
    columns)."""
    columns = frame.columns
    out = []
    for ts, label, status, *counts, cost, latency, request_id in zip(*columns, strict=True):
        out.append((ts, *frame.labels[label], status, *counts, _FROM_WIRE.get(cost, cost),
                    latency, request_id))
    return out


def costs(column: Sequence[int]) -> Any:
    """The cost column with None back for an unknown cost."""
    return map(_FROM_WIRE.get, column, column)
