"""Declared records: the data the native core reads, laid out once here and once in C.

The native access-log formatter (native/bind_books.c, `access_line`/`access_lines`) reads a
request's fields by position from an `AccessRecord`, never by attribute name: mypy checks the
attributes read here, and the order of `ACCESS_FIELDS` is the C's enum of indexes, which the
extension exports as `_native.ACCESS_FIELDS` (tests/unit/test_records.py compares the two).
Reading attributes by name from C once failed silently: a meter class lacking four of them made
every plain answer's line be skipped.

A plain tuple, not a struct sequence or a named tuple: building one is a single BUILD_TUPLE
(59 ns for 17 fields, timeit on this project's 2-core host), where a struct sequence is a call
taking a tuple (184 ns for `time.struct_time`'s 11) and a named tuple a Python `__new__` (419
ns for 17); C reads all three the same way. The whole line, record included, costs ~0.52 us
against 0.61 when C read the sixteen attributes itself (1,024 real pipeline items per call).

`access_record` is the one place a log line's fields are gathered: the log calls it when the
request has ended and its meter has settled (velox.admin.accesslog), so the queue between that
and the timer's write holds scalars, not the request and its exchange.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from velox.core.types import Headers, Request

# The record's fields in order (native/bind_books.c: enum access_field). `usage_exact`: None
# when no usage was accounted, else whether usage_input/usage_output are the upstream's own.
# `request_id`: the upstream's x-request-id, None for none (the log makes one). `cost`: nano-USD
# when the meter priced the request (velox.spend), else None; a priced log writes it as
# cost_usd. Scalars only: a record waits in the log's queue up to 50 ms, and one holding a list
# (the answer's headers, as it once did) stays tracked by the cyclic GC all that time.
ACCESS_FIELDS = (
    "t_end", "status", "bytes_out", "method", "path", "model", "bytes_in", "t_received", "key",
    "upstream", "attempts", "t_sent", "t_headers", "request_id", "usage_input", "usage_output",
    "usage_exact", "cost",
)

AccessRecord = tuple[int, int, int, bytes, bytes, "str | None", int, int, int, bytes, int, int,
                     int, "bytes | None", int, int, "bool | None", "int | None"]


class LoggedMeter(Protocol):
    """What a line reads of a request's token meter (velox.relay.usage.TokenMeter, a batch
    member's Share, pricing's wrapper; the last two also have `cost`, read when present)."""

    @property
    def done(self) -> bool: ...

    @property
    def input(self) -> int: ...

    @property
    def output(self) -> int: ...

    @property
    def exact(self) -> bool: ...


class Logged(Protocol):
    """What a line reads of the call that answered (velox.relay.exchange.Exchange, a batch
    member of velox.batching.batch)."""

    @property
    def meter(self) -> LoggedMeter | None: ...

    @property
    def upstream_name(self) -> bytes: ...

    @property
    def attempts(self) -> int: ...

    @property
    def t_sent(self) -> int: ...

    @property
    def t_headers(self) -> int: ...

    @property
    def headers(self) -> Headers: ...


# An access-log queue item: (t_end_ns, request, what answered or None, status, bytes_out).
LogItem = tuple[int, Request, "Logged | None", int, int]


def access_record(item: LogItem) -> AccessRecord:
    """One item's record; raises what reading its fields raised (a holder or meter lacking
    one: the log tells it once, AccessLog._tell)."""
    t_end, request, holder, status, bytes_out = item
    if holder is None:
        return (t_end, status, bytes_out, request.method, request.path, request.model,
                len(request.body), request.t_received, request.key, b"", 0, 0, 0, None, 0, 0, None,
                None)
    meter = holder.meter
    if meter is not None and meter.done:
        inp, out, exact = meter.input, meter.output, bool(meter.exact)
    else:
        inp = out = 0
        exact = None
    cost = None if meter is None else getattr(meter, "cost", None)  # priced meters only
    upstream, attempts, t_sent = holder.upstream_name, holder.attempts, holder.t_sent
    t_headers = holder.t_headers
    request_id = None
    for name, value in holder.headers:
        if name == b"x-request-id":
            request_id = value
            break
    return (t_end, status, bytes_out, request.method, request.path, request.model,
            len(request.body), request.t_received, request.key, upstream, attempts, t_sent,
            t_headers, request_id, inp, out, exact, cost)


def access_records(items: Iterable[LogItem]) -> list[AccessRecord | None]:
    """The record of each item; None for an item whose fields cannot be read (the formatter
    skips it, so one bad item does not cost the others their lines)."""
    records: list[AccessRecord | None] = []
    append = records.append
    for item in items:
        try:
            append(access_record(item))
        except Exception:  # told by the log once (AccessLog._tell)
            append(None)
    return records
