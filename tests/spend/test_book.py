"""The priced answer's one native call (velox._native.SpendBook) against its Python twin
(velox.spend.book.BookTwin): the same costs, cost headers, /metrics counters and ledger
columns for any sequence of answers, the overflow refusals included; the price record's
declared order; the columns' frame read back by the supervisor's decoder."""

from __future__ import annotations

import random
import time
from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox import _native
from velox.spend.book import (
    API_NAMES,
    API_PATHS,
    PRICE_FIELDS,
    BookTwin,
    cost_of,
    label_parts,
    price_record,
)
from velox.spend.gate import usd_text
from velox.spend.prices import PriceTable, cost_nanos
from velox.spend.rowframe import INT_COLUMNS, NO_COST, pack_columns, rows_of, unpack
from velox.spend.wire import _Usage
from velox.state.stats import Counters

WIDTH, KEYS, SLOT = 3, 4, 1
_FIELDS = (KEYS + 1) * WIDTH * 2


def test_the_price_record_is_declared_in_the_order_the_c_reads_it() -> None:
    assert _native.SPEND_PRICE_FIELDS == PRICE_FIELDS


def test_the_record_prices_every_shipped_entry_as_the_reference_does() -> None:
    rng = random.Random(11)
    for spec in PriceTable().entries:
        record = price_record(spec)
        assert record is not None
        for _ in range(20):
            usage = (rng.randrange(-5, 10**7), rng.randrange(-5, 10**6), rng.randrange(-5, 10**7),
                     rng.randrange(0, 10**5), rng.randrange(0, 10**6))
            assert cost_of(record, usage) == cost_nanos(spec, _Usage(*usage)), spec


_I64 = (1 << 63) - 1
_count = st.one_of(st.integers(-3, 5000), st.integers(0, 10**15),
                   st.integers(-(1 << 64), 1 << 64))
_part_price = st.one_of(st.just(-1), st.integers(0, 10**7))
_price = st.one_of(
    st.none(), st.integers(-(1 << 63) + 1, _I64),
    st.tuples(st.integers(0, 10**8), st.integers(0, 10**8), _part_price, _part_price,
              _part_price, st.integers(0, 10**6)),
    st.tuples(st.integers(0, 1 << 62), st.integers(0, 1 << 62), _part_price, _part_price,
              _part_price, st.integers(0, _I64)))
_path = st.sampled_from([*API_PATHS, b"/v1/chat/completions?x=1", b"/v1/models", b"", b"?"])
_request_id = st.one_of(st.none(), st.binary(max_size=200))
_answer = st.tuples(_price, _count, _count, _count, _count, _count,
                    st.sampled_from([-2, -1, 0, 1, KEYS - 1, KEYS, KEYS + 5]),
                    st.sampled_from([-1, 0, 1, WIDTH - 1, 1000]), st.integers(0, (1 << 24) - 1),
                    st.sampled_from([200, 429, 499, 502]), _path, _request_id, st.booleans())


def _call(book: Any, answer: tuple[Any, ...], t_received: int) -> Any:
    price, inp, out, cached, written, reasoning, key, index, target, status, path, rid, head = \
        answer
    try:
        return book.answer(price, inp, out, cached, written, reasoning, key, index, target,
                           status, t_received, path, rid, head)
    except (ValueError, IndexError) as exc:
        return type(exc)


@settings(max_examples=400, deadline=None)
@given(st.lists(_answer, max_size=40), st.integers(0, 50))
def test_the_native_book_matches_its_twin(answers: list[tuple[Any, ...]], rows_max: int) -> None:
    counters = [Counters(SLOT + 1, _FIELDS), Counters(SLOT + 1, _FIELDS)]
    native = _native.SpendBook((counters[0],), SLOT, WIDTH, KEYS, API_PATHS)
    twin = BookTwin((counters[1],), SLOT, WIDTH, KEYS)
    native.rows_max = twin.rows_max = rows_max
    t0 = time.time_ns() // 1_000_000
    received = time.perf_counter_ns()
    for answer in answers:
        assert _call(native, answer, received) == _call(twin, answer, received), answer
    assert native.rows == twin.rows and native.dropped == twin.dropped
    assert [counters[0].get(SLOT, f) for f in range(_FIELDS)] == \
        [counters[1].get(SLOT, f) for f in range(_FIELDS)]
    t1 = time.time_ns() // 1_000_000
    took, twin_took = native.take(), twin.take()
    assert native.take() is None and native.rows == 0
    if twin_took is None:
        assert took is None
        return
    assert took is not None
    rows, ints, labels, ids = took
    assert (rows, labels, ids) == twin_took[:1] + twin_took[2:]
    mine, theirs = array("q", ints), array("q", twin_took[1])
    for c, name in enumerate(INT_COLUMNS):
        column, reference = mine[c * rows:(c + 1) * rows], theirs[c * rows:(c + 1) * rows]
        if name == "ts_ms":
            assert all(t0 <= t <= t1 for t in column)
        elif name == "latency_us":
            assert all(0 <= v <= (time.perf_counter_ns() - received) // 1000 for v in column)
        else:
            assert column == reference, name


def test_a_cost_past_64_bits_is_refused_whole_and_counts_nothing() -> None:
    counters = Counters(SLOT + 1, _FIELDS)
    book = _native.SpendBook((counters,), SLOT, WIDTH, KEYS, API_PATHS)
    book.rows_max = 10
    dear = (1 << 40, 1 << 40, -1, -1, -1, 0)
    with pytest.raises(ValueError):
        book.answer(dear, 1 << 30, 0, 0, 0, 0, 0, 0, 0, 200, 0, b"/v1/chat/completions", None,
                    True)
    with pytest.raises(ValueError):  # a count past int64, as orjson may read one
        book.answer(dear, 1 << 70, 0, 0, 0, 0, 0, 0, 0, 200, 0, b"/v1/chat/completions", None,
                    True)
    assert book.rows == 0 and sum(counters.get(SLOT, f) for f in range(_FIELDS)) == 0


def test_the_header_and_the_counter_of_one_answer() -> None:
    counters = Counters(SLOT + 1, _FIELDS)
    book = _native.SpendBook((counters,), SLOT, WIDTH, KEYS, API_PATHS)
    record = (150_000, 600_000, 75_000, -1, -1, 0)  # gpt-4o-mini's list price, per token
    cost, header = book.answer(record, 1000, 200, 0, 0, 0, 1, 2, 7, 200, 0,
                               b"/v1/chat/completions", b"req-1", True)
    assert cost == (1000 * 150_000 + 200 * 600_000 + 500) // 1000
    assert header == (b"x-velox-cost-usd", usd_text(cost))
    assert counters.get(SLOT, ((1 + 1) * WIDTH + 2) * 2) == cost
    assert book.answer(record, 1000, 200, 0, 0, 0, 1, 2, 7, 200, 0, b"/v1/chat/completions",
                       None, True) == (cost, header)  # the last result, again
    assert book.answer(None, 1, 1, 0, 0, 0, 1, 2, 7, 200, 0, b"/x", None, True) == (None, None)
    assert counters.get(SLOT, ((1 + 1) * WIDTH + 2) * 2 + 1) == 1  # one of unknown cost
    assert book.rows == 0  # no ledger feed: no rows kept


def test_the_columns_frame_reads_back_through_the_supervisors_decoder() -> None:
    book = _native.SpendBook((), 0, WIDTH, KEYS, API_PATHS)
    book.rows_max = 100
    record = (1000, 2000, -1, -1, -1, 5)
    ids = [b"req-\xe9", None, b"a\x00b", b"x" * 300]
    answers = [(0, 4, b"/v1/chat/completions"), (2, 9, b"/v1/embeddings?q"), (0, 4,
               b"/v1/chat/completions"), (-1, 9, b"/other")]
    for (key, target, path), rid in zip(answers, ids, strict=True):
        book.answer(record, 10, 20, 1, 0, 3, key, 0, target, 200, time.perf_counter_ns(), path,
                    rid, False)
    book.answer(None, 10, 20, 0, 0, 0, 1, 0, 4, 502, time.perf_counter_ns(), b"/v1/responses",
                None, False)
    rows, ints, labels, text = book.take()  # type: ignore[misc]
    names = {0: "k0", 1: "k1", 2: "k2"}
    named = [(names.get(label_parts(label)[0], ""), "team", "route", f"up{label_parts(label)[1]}",
              "model", API_NAMES[label_parts(label)[2]]) for label in labels]
    frame = unpack(pack_columns(rows, ints, named, text))
    got = rows_of(frame)
    assert [r[1] for r in got] == ["k0", "k2", "k0", "", "k1"]
    assert [r[4] for r in got] == ["up4", "up9", "up4", "up9", "up4"]
    assert [r[6] for r in got] == ["chat", "embeddings", "chat", "other", "responses"]
    assert [r[-1] for r in got] == ["req-é", "", "a\ufffdb", "x" * 128, ""]
    cost = (10 * 1000 + 20 * 2000 + 500) // 1000 + 5
    assert [r[13] for r in got] == [cost] * 4 + [None]
    assert got[0][7:13] == (200, 10, 20, 1, 0, 3)
    assert NO_COST not in [r[13] for r in got]


def test_an_unknown_cost_after_the_largest_known_one_is_still_unknown() -> None:
    """The book returns its last answer again for the same cost; the cache's key once folded
    "no header" into -1 - cost, which for INT64_MAX was the unknown cost's key."""
    counters = Counters(SLOT + 1, _FIELDS)
    book = _native.SpendBook((counters,), SLOT, WIDTH, KEYS, API_PATHS)
    args = (0, 0, 0, 0, 0, -2, 0, 0, 200, 0, b"/v1/chat/completions", None, False)
    assert book.answer(_I64, *args) == (_I64, None)
    assert book.answer(None, *args) == (None, None)
    assert book.answer(_I64, *args) == (_I64, None)
