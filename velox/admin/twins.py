"""Pure-Python reference twins of the native access log (native/bind_books.c).

`access_line` makes a line of a declared record (velox.relay.records) as the log made it before
the native formatter: the line's dict through orjson. The native one writes the same bytes about
4x cheaper. `AccessBook` is the worker's buffer of lines between two flushes, made of those
lines: its room, drops, sequence numbers and chunks of whole lines. tests/native/
test_books_twins.py drives both with generated records and calls, hostile strings and header
values included, and compares the bytes. VELOX_NATIVE=0 runs the log on them
(velox.admin.accesslog.AccessLog's `native`).
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from velox.relay.records import ACCESS_FIELDS
from velox.spend.gate import usd_text

MAX_FIELD = 512  # bytes of path and request id, characters of model (accesslog._MAX_FIELD)
_METHOD_MAX = 16


def _stamp(wall_ns: int) -> str:
    ms = wall_ns // 1_000_000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


def _model(model: object) -> str | None:
    if not isinstance(model, str) or not model:
        return None
    try:
        model.encode()
    except UnicodeEncodeError:  # lone surrogates: null rather than a lost line
        return None
    return model[:MAX_FIELD]


def _header_id(headers: list[Any] | tuple[Any, ...]) -> Any:
    """The first x-request-id among header pairs (other items passed over), else None."""
    for pair in headers:
        if isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], bytes) and \
                pair[0] == b"x-request-id":
            return pair[1]
    return None


def _request_id(request_id: Any, prefix: bytes, seq: int) -> str:
    if isinstance(request_id, (list, tuple)):  # the answer's headers
        request_id = _header_id(request_id)
    if request_id is not None:
        if not isinstance(request_id, bytes):
            raise TypeError("access_line: a record's request_id must be bytes, None or the "
                            "headers")
        return request_id[:MAX_FIELD].decode("latin-1")
    return prefix.decode("latin-1") + format(seq & ((1 << 64) - 1), "x")


def access_line(record: tuple[Any, ...], wall_offset_ns: int, worker: int, prefix: bytes,
                seq: int, key_names: tuple[str, ...], priced: bool = False) -> bytes:
    """The line of `record` (laid out as ACCESS_FIELDS), newline included; `priced`: with
    cost_usd last, as the log made it by splicing usd_text in before its closing brace."""
    if type(record) is not tuple or len(record) != len(ACCESS_FIELDS):
        raise TypeError(f"access_line: a record must be a {len(ACCESS_FIELDS)}-tuple")
    f = dict(zip(ACCESS_FIELDS, record, strict=True))
    t_end, t_sent, t_headers, key = f["t_end"], f["t_sent"], f["t_headers"], f["key"]
    name = key_names[key] if 0 <= key < len(key_names) else None
    exact = f["usage_exact"]
    line = orjson.dumps({
        "time": _stamp(t_end + wall_offset_ns), "log": "access", "worker": worker,
        "method": f["method"][:_METHOD_MAX].decode("latin-1"),
        "path": f["path"].split(b"?", 1)[0][:MAX_FIELD].decode("latin-1"),
        "model": _model(f["model"]), "status": f["status"], "bytes_in": f["bytes_in"],
        "bytes_out": f["bytes_out"], "upstream": f["upstream"].decode() or None,
        "attempts": f["attempts"],
        "upstream_us": (t_headers - t_sent) // 1000 if t_headers and t_sent else None,
        "total_us": (t_end - f["t_received"]) // 1000 if t_end > f["t_received"] else 0,
        "request_id": _request_id(f["request_id"], prefix, seq),
        "key": name if isinstance(name, str) else None,
        "usage": None if exact is None else {"input": f["usage_input"],
                                             "output": f["usage_output"],
                                             "exact": exact is True},
    }, option=orjson.OPT_APPEND_NEWLINE)
    if not priced:
        return line
    cost = f["cost"]
    if cost is not None and not -(1 << 63) <= cost < 1 << 63:
        raise OverflowError("access_line: a cost must fit in 64 bits")
    return line[:-2] + b',"cost_usd":' + (b"null" if cost is None else usd_text(cost)) + b"}\n"


class AccessBook:
    """The native AccessBook in Python: `add` makes a line (access_line of the fields, the
    next sequence number) and keeps it while the buffer stays within `room`, else drops and
    counts it; `take` gives the lines as chunks of whole lines of at most `limit` bytes (a
    longer one alone) with their counts, and the drops since the last take."""

    def __init__(self, worker: int, prefix: bytes, key_names: tuple[str, ...], priced: bool,
                 room: int) -> None:
        self.worker, self.prefix, self.key_names = worker, prefix, key_names
        self.priced, self.room = priced, room
        self.wall_offset = self.seq = self.size = self.dropped = 0
        self._lines: list[bytes] = []

    def __len__(self) -> int:
        return len(self._lines)

    def add(self, *fields: Any) -> None:
        if len(fields) != len(ACCESS_FIELDS):
            raise TypeError(f"add() takes exactly {len(ACCESS_FIELDS)} positional arguments")
        line = access_line(fields, self.wall_offset, self.worker, self.prefix, self.seq + 1,
                           self.key_names, self.priced)
        self.seq += 1
        if self.size + len(line) > self.room:
            self.dropped += 1
            return
        self._lines.append(line)
        self.size += len(line)

    def take(self, limit: int) -> tuple[list[tuple[bytes, int]], int]:
        chunks: list[tuple[bytes, int]] = []
        chunk: list[bytes] = []
        size = 0
        for line in self._lines:
            if chunk and size + len(line) > limit:
                chunks.append((b"".join(chunk), len(chunk)))
                chunk, size = [], 0
            chunk.append(line)
            size += len(line)
        if chunk:
            chunks.append((b"".join(chunk), len(chunk)))
        dropped = self.dropped
        self._lines, self.size, self.dropped = [], 0, 0
        return chunks, dropped
