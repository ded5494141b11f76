"""Pure-Python reference twin of the native access-log line (native/bind_books.c).

`access_line` makes a line of a declared record (velox.relay.records) as the log made it before
the native formatter: the line's dict through orjson. The native one writes the same bytes about
4x cheaper; tests/native/test_books_twins.py drives both with generated records, hostile strings
included, and compares the bytes. A reference, not a switch: the log always formats natively.
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


def _request_id(request_id: bytes | None, prefix: bytes, seq: int) -> str:
    if request_id is not None:
        if not isinstance(request_id, bytes):
            raise TypeError("access_line: a record's request_id must be bytes or None")
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
