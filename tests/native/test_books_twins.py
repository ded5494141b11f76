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

from velox._native import ACCESS_FIELDS, AccessBook, access_line
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


# --- the worker's buffer of lines (AccessBook) against its twin ------------------------------

HOSTILE_ID = st.one_of(BYTES, st.sampled_from([b'"q\\\x00\n\r\t\x1f\x7f\xe9\xff', b"\\u0000",
                                               b"</script>", b"r" * 700]))
# The answer's header pairs as codecs hand them (lower-case names), with what either reader
# must pass over: other names and spellings, non-pairs, several ids (the first counts), and
# values that are not bytes (None: no id; anything else refused).
HEADER = st.one_of(
    st.tuples(st.sampled_from([b"x-request-id", b"content-type", b"X-Request-Id",
                               b"x-request-id ", b"x-request-ids", b""]), HOSTILE_ID),
    st.tuples(st.just(b"x-request-id"), st.sampled_from([None, "text", 7])),
    st.sampled_from([(b"x-request-id",), (b"x-request-id", b"a", b"b"), [b"x-request-id", b"l"],
                     b"x-request-id", ("x-request-id", b"str-name")]),
)


@st.composite
def book_fields(draw: st.DrawFn) -> tuple[Any, ...]:
    record = list(draw(records()))
    record[ACCESS_FIELDS.index("request_id")] = draw(st.one_of(
        st.none(), HOSTILE_ID, st.lists(HEADER, max_size=5),
        st.lists(HEADER, max_size=3).map(tuple)))
    return tuple(record)


BOOK_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), book_fields()),
    st.tuples(st.just("take"), st.integers(1, 3000)),
    st.tuples(st.just("room"), st.integers(0, 6000)),
    st.tuples(st.just("wall_offset"), st.integers(0, 1 << 61)),
    st.tuples(st.just("key_names"), st.lists(st.text(max_size=8), max_size=3).map(tuple)),
), max_size=40)


def _run(book: Any, op: str, arg: Any) -> Any:
    """One call on a book: its result, or the type of what it raised."""
    try:
        if op == "add":
            return book.add(*arg)
        if op == "take":
            return book.take(arg)
        setattr(book, op, arg)
        return None
    except Exception as exc:
        return type(exc)


@settings(max_examples=400, deadline=None)
@given(BOOK_OPS, st.integers(0, 4096), st.booleans(), st.integers(0, 8000))
def test_the_native_book_is_its_twins(ops: list[tuple[str, Any]], worker: int, priced: bool,
                                      room: int) -> None:
    prefix = b"velox-2-0a0b-"
    native = AccessBook(worker, prefix, ("k",), priced, room)
    twin = twins.AccessBook(worker, prefix, ("k",), priced, room)
    for op, arg in (*ops, ("take", 700)):
        assert _run(native, op, arg) == _run(twin, op, arg), op
        assert (len(native), native.size, native.seq, native.dropped) == \
            (len(twin), twin.size, twin.seq, twin.dropped), op


def test_a_full_book_drops_and_counts_and_its_chunks_hold_whole_lines() -> None:
    # Lines are kept while they fit the room, dropped (not held, not waited for) past it, and
    # taken as chunks of whole lines; the first x-request-id among the headers is the line's.
    headers = [(b"content-type", b"application/json"), (b"x-request-id", b'id "1"\n'),
               (b"x-request-id", b"second")]
    fields = [0, 200, 10, b"POST", b"/v1/x?k=sk-1", "m", 5, 0, -1, b"u", 1, 1, 2, headers, 3, 4,
              True, None]
    line = twins.access_line(tuple(fields), 0, 0, b"p-", 1, (), True)
    assert b'"request_id":"id \\"1\\"\\n"' in line and b'"cost_usd":null' in line
    for book in (AccessBook(0, b"p-", (), True, 3 * len(line)),
                 twins.AccessBook(0, b"p-", (), True, 3 * len(line))):
        for bytes_out in range(5):
            fields[2] = bytes_out
            book.add(*fields)
        assert (len(book), book.dropped, book.seq) == (3, 2, 5)
        chunks, dropped = book.take(2 * len(line))
        assert dropped == 2 and [n for _, n in chunks] == [2, 1]
        assert b"".join(c for c, _ in chunks).count(b"\n") == 3 and len(book) == 0
