"""The declared records crossing the native boundary: the layout Python states
(velox.relay.records) is the one the C reads (native/bind_books.c exports its enum's names), and
each field lands where the line says it does.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, get_args

import orjson

from velox import _native
from velox.core.types import Kind, Request
from velox.relay.records import ACCESS_FIELDS, AccessRecord, access_record, access_records
from velox_lab.pipeline import Pipeline


def test_the_c_reads_the_layout_python_declares() -> None:
    assert _native.ACCESS_FIELDS == ACCESS_FIELDS
    assert len(get_args(AccessRecord)) == len(ACCESS_FIELDS)


def _logged_items() -> list[tuple[Any, ...]]:
    """Real items of the access log: a pipeline round's requests and their exchanges."""
    pipeline = Pipeline(clients=4, codec="native")
    items: list[tuple[Any, ...]] = []
    pipeline.worker.log_access = items.append
    pipeline.round()
    return items


def test_every_field_is_read_from_its_own_position() -> None:
    items = _logged_items()
    request = Request(None, b"GET", b"/v1/models", Kind.FORWARD, [], b"", True,  # type: ignore[arg-type]
                      5_000)
    items.append((9_000_000, request, None, 404, 12))
    meter = SimpleNamespace(done=True, input=7, output=3, exact=False)
    member = SimpleNamespace(meter=meter, upstream_name=b"second", attempts=3, t_sent=1_000_000,
                             t_headers=4_500_000, headers=[(b"x-request-id", b"req-9")])
    items.append((items[0][0], items[0][1], member, 201, 99))
    for record in access_records(items):
        assert record is not None and len(record) == len(ACCESS_FIELDS)
        field = dict(zip(ACCESS_FIELDS, record, strict=True))
        line = orjson.loads(_native.access_line(record, 0, 0, b"p-", 1, ("k",)))
        for name in ("status", "bytes_out", "bytes_in", "attempts"):
            assert line[name] == field[name], name
        assert line["method"] == field["method"].decode()
        assert line["path"] == field["path"].decode()
        assert line["model"] == field["model"]
        assert line["upstream"] == (field["upstream"].decode() or None)
        assert line["total_us"] == max(0, field["t_end"] - field["t_received"]) // 1000
        assert line["key"] == ("k" if field["key"] == 0 else None)
        if field["t_sent"] and field["t_headers"]:
            assert line["upstream_us"] == (field["t_headers"] - field["t_sent"]) // 1000
        else:
            assert line["upstream_us"] is None
        if field["usage_exact"] is None:
            assert line["usage"] is None
        else:
            assert line["usage"] == {"input": field["usage_input"],
                                     "output": field["usage_output"],
                                     "exact": field["usage_exact"]}
    assert orjson.loads(_native.access_line(access_record(items[-1]), 0, 0, b"p-", 1, ()))[
        "request_id"] == "req-9"


def test_a_record_of_another_layout_is_refused_not_misread() -> None:
    record = access_record(_logged_items()[0])
    for bad in (record[:-1], (*record, 0), None):
        try:
            _native.access_line(bad, 0, 0, b"p-", 1, ())
        except TypeError as exc:
            assert "ACCESS_FIELDS" in str(exc)
        else:
            raise AssertionError(f"a record of {len(bad or ())} fields was formatted")


def test_a_holder_without_a_field_gives_no_record_and_access_record_says_which() -> None:
    item = _logged_items()[0]
    bad = (item[0], item[1], SimpleNamespace(meter=None), 200, 1)
    assert access_records([bad, item])[0] is None
    try:
        access_record(bad)  # type: ignore[arg-type]
    except AttributeError as exc:
        assert "upstream_name" in str(exc)
    else:
        raise AssertionError("a holder without upstream_name made a record")
