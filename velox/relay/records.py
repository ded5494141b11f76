"""Declared records: the data the native core reads, laid out once here and once in C.

The native access log (native/bind_books.c: `AccessBook.add`, `access_line`) reads a request's
fields by position, as the arguments of one call or from an `AccessRecord` tuple, never by
attribute name: mypy checks the attributes read here, and the order of `ACCESS_FIELDS` is the
C's enum of indexes, which the extension exports as `_native.ACCESS_FIELDS`
(tests/unit/test_records.py compares the two). Reading attributes by name from C once failed
silently: a meter class lacking four of them made every plain answer's line be skipped.

`log_fields` is the one place a log line's fields are gathered: the log calls it with its
book's `add` when the request has ended and its meter has settled (velox.admin.accesslog), and
C writes the line into the worker's buffer there and then: no record object, no queue of them.
`access_record` gathers the same fields into a tuple (the tests' and `access_line`'s form).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from velox.core.types import Headers, Request

# The record's fields in order (native/bind_books.c: enum access_field). `usage_exact`: None
# when no usage was accounted, else whether usage_input/usage_output are the upstream's own.
# `request_id`: the upstream's x-request-id, None for none (the log makes one), or the answer's
# header pairs, in which C finds it (one pass in C against ~0.3 us for the loop in Python).
# `cost`: nano-USD when the meter priced the request (velox.spend), else None; a priced log
# writes it as cost_usd.
ACCESS_FIELDS = (
    "t_end", "status", "bytes_out", "method", "path", "model", "bytes_in", "t_received", "key",
    "upstream", "attempts", "t_sent", "t_headers", "request_id", "usage_input", "usage_output",
    "usage_exact", "cost",
)

AccessRecord = tuple[int, int, int, bytes, bytes, "str | None", int, int, int, bytes, int, int,
                     int, "bytes | Headers | None", int, int, "bool | None", "int | None"]


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


T = TypeVar("T")


def log_fields(add: Callable[..., T], item: LogItem) -> T:
    """`add` called with the item's fields in ACCESS_FIELDS' order (the request id as the
    answer's headers); raises what reading them raised (a holder or meter lacking one: the
    log tells it once)."""
    t_end, request, holder, status, bytes_out = item
    if holder is None:
        return add(t_end, status, bytes_out, request.method, request.path, request.model,
                   len(request.body), request.t_received, request.key, b"", 0, 0, 0, None, 0, 0,
                   None, None)
    meter = holder.meter
    if meter is not None and meter.done:
        inp, out, exact = meter.input, meter.output, bool(meter.exact)
    else:
        inp = out = 0
        exact = None
    cost = None if meter is None else getattr(meter, "cost", None)  # priced meters only
    return add(t_end, status, bytes_out, request.method, request.path, request.model,
               len(request.body), request.t_received, request.key, holder.upstream_name,
               holder.attempts, holder.t_sent, holder.t_headers, holder.headers, inp, out, exact,
               cost)


def _record(*fields: Any) -> AccessRecord:
    return fields


def access_record(item: LogItem) -> AccessRecord:
    """One item's record (log_fields into a tuple)."""
    return log_fields(_record, item)


def access_records(items: Iterable[LogItem]) -> list[AccessRecord | None]:
    """The record of each item; None for an item whose fields cannot be read (the formatter
    skips it, so one bad item does not cost the others their lines)."""
    records: list[AccessRecord | None] = []
    append = records.append
    for item in items:
        try:
            append(access_record(item))
        except Exception:  # the formatter skips it
            append(None)
    return records
