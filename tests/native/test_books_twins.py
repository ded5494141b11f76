"""The native access-log line against its Python twin (velox.admin.twins).

Hypothesis generates declared records (velox.relay.records.ACCESS_FIELDS) with hostile strings
(quotes, backslashes, control bytes, latin-1, non-BMP text, lone surrogates, query strings,
overlong fields), times around the epoch and far from it, missing and present usage and request
ids, keys in and out of the names (which come from the keys file: valid text), costs of every
64-bit size, priced or not; the native line must be the twin's bytes exactly.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from velox._native import ACCESS_FIELDS, access_line
from velox.admin import twins

TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "m" * 700, "a\ud800b", 'q"\\\n\x00',
                                                        "\u2028\U0001f600"]))
BYTES = st.one_of(st.binary(max_size=40), st.sampled_from([b"/v1/a?key=sk-1", b"x" * 600, b""]))
NS = st.integers(0, 1 << 62)


@st.composite
def records(draw: st.DrawFn) -> tuple[Any, ...]:
    usage = draw(st.sampled_from([None, True, False]))
    field = {
        "t_end": draw(NS), "status": draw(st.integers(0, 999)), "bytes_out": draw(NS),
        "method": draw(BYTES), "path": draw(BYTES), "model": draw(st.one_of(st.none(), TEXT)),
        "bytes_in": draw(NS), "t_received": draw(NS), "key": draw(st.integers(-3, 4)),
        "upstream": draw(st.text(max_size=20)).encode(), "attempts": draw(st.integers(0, 9)),
        "t_sent": draw(st.one_of(st.just(0), NS)), "t_headers": draw(st.one_of(st.just(0), NS)),
        "request_id": draw(st.one_of(st.none(), BYTES)),
        "usage_input": draw(st.integers(0, 1 << 40)), "usage_output": draw(st.integers(0, 1 << 40)),
        "usage_exact": usage,
        # nano-USD: none, whole dollars, trailing zeros, negative (Python's divmod), extremes
        "cost": draw(st.one_of(st.none(), st.integers(-(1 << 63), (1 << 63) - 1),
                               st.integers(0, 10**12), st.sampled_from([0, 10**9, 1500, -1]))),
    }
    return tuple(field[name] for name in ACCESS_FIELDS)


@settings(max_examples=800, deadline=None)
@given(records(), st.integers(0, 1 << 61), st.integers(0, 4096), st.integers(0, (1 << 63) - 1),
       st.lists(st.one_of(st.text(max_size=20), st.just('team "a"\\\n')), max_size=3).map(tuple),
       st.booleans())
def test_the_native_line_is_its_twins(record: tuple[Any, ...], offset: int, worker: int,
                                      seq: int, names: tuple[str, ...], priced: bool) -> None:
    prefix = b"velox-1-00ff-"
    assert access_line(record, offset, worker, prefix, seq, names, priced) == \
        twins.access_line(record, offset, worker, prefix, seq, names, priced)


def test_a_cost_beyond_64_bits_is_refused_by_both_and_ignored_unpriced() -> None:
    record = (0, 0, 0, b"POST", b"/v1/x", None, 0, 0, 0, b"", 0, 0, 0, None, 0, 0, None, 1 << 64)
    for line in (access_line, twins.access_line):
        try:
            line(record, 0, 0, b"p-", 1, (), True)
        except OverflowError:
            pass
        else:
            raise AssertionError(f"{line} wrote a cost of 2**64")
    assert access_line(record, 0, 0, b"p-", 1, ()) == twins.access_line(record, 0, 0, b"p-", 1, ())


def test_both_refuse_a_record_of_another_layout() -> None:
    for bad in ((), (0,) * (len(ACCESS_FIELDS) + 1), None):
        for line in (access_line, twins.access_line):
            try:
                line(bad, 0, 0, b"p-", 1, ())  # type: ignore[arg-type]
            except TypeError:
                continue
            raise AssertionError(f"{line} formatted {bad!r}")
