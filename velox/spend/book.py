"""A worker's priced answers in one call: the declared records the native `SpendBook` reads,
and its Python twin.

`SpendBook.answer` (native/bind_spend.c) takes one answer's usage and does what were ~15
Python-level steps of the request path (~6 us a request end to end with spend on): its cost
from the target's price record, the `x-velox-cost-usd` field, /metrics' spend counter, and
the ledger row appended to per-column int64 buffers, which `take` hands to the feed's flush
as the frame's columns (velox.spend.rowframe) without a transpose.

Records the C reads by position, declared here once: a price is `PRICE_FIELDS` (pico-USD per
token for the token prices, -1 for a part billed at its parent's price; nano-USD per
request), exported by the extension as `SPEND_PRICE_FIELDS` for the test that compares the
two. A row's label (key, team, route, upstream, model, api: velox.spend.rowframe.NAMED) is one
int, `(key + 1) << 32 | target << 8 | api`, whose names the Spend gives back at flush
(`names`): a target's number is the Spend's (velox.spend.wire.Spend.target), an api's is its
path's index in `API_PATHS` (any other path: `len(API_PATHS)`, "other").

`BookTwin` is the same in Python: the reference the differential test runs beside the
native one, step for step, and the book a worker uses with VELOX_NATIVE=0
(velox.spend.wire.Spend's `native`).
"""

from __future__ import annotations

import time
from array import array
from typing import Any

from velox._native import SpendBook as SpendBook  # re-exported: the book's native face
from velox.config.tables import PriceSpec
from velox.spend.gate import usd_text
from velox.spend.prices import PICO_PER_NANO
from velox.spend.rowframe import INT_COLUMNS, NO_COST

PRICE_FIELDS = ("input", "output", "cached_input", "cache_write", "reasoning", "request")
COST_HEADER = b"x-velox-cost-usd"
# The ledger's `api` column, by the request's upstream path (its query string cut).
API_PATHS = (b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings", b"/v1/responses",
             b"/v1/messages")
API_NAMES = ("chat", "completions", "embeddings", "responses", "messages", "other")
NOT_BOOKED = -2  # velox.relay.usage.NOT_BOOKED: a merged call's key books nothing here
_BLOCK_SHIFT, _BLOCK_MASK = 12, (1 << 12) - 1  # the spend counters' blocks (TOKEN_BLOCK)
ID_CHARS = 128  # a ledger row's request id, at most
_LIMIT = (1 << 63) - 1


def price_record(price: PriceSpec | None) -> tuple[int, ...] | None:
    """A price as the native book reads it (PRICE_FIELDS), None for no price."""
    if price is None:
        return None
    return (price.input, price.output, _or_parent(price.cached_input),
            _or_parent(price.cache_write), _or_parent(price.reasoning), price.request)


def _or_parent(value: int | None) -> int:
    return -1 if value is None else value


def label_parts(label: int) -> tuple[int, int, int]:
    """(key, target, api) of a row's label."""
    return (label >> 32) - 1, (label >> 8) & 0xFFFFFF, label & 0xFF


def cost_of(price: tuple[int, ...], usage: tuple[int, int, int, int, int]) -> int:
    """velox.spend.prices.cost_nanos over a price record (no images)."""
    return (_pico(price, usage) + PICO_PER_NANO // 2) // PICO_PER_NANO + price[5]


def _pico(price: tuple[int, ...], usage: tuple[int, int, int, int, int]) -> int:
    inp, out, cached, written, reasoning = usage
    total_in = max(inp, 0)
    cached = min(max(cached, 0), total_in)
    written = min(max(written, 0), total_in - cached)
    total_out = max(out, 0)
    reasoning = min(max(reasoning, 0), total_out)
    p_in, p_out, p_cached, p_write, p_reason, _ = price
    pico = ((total_in - cached - written) * p_in
            + cached * (p_in if p_cached < 0 else p_cached)
            + written * (p_in if p_write < 0 else p_write)
            + (total_out - reasoning) * p_out
            + reasoning * (p_out if p_reason < 0 else p_reason))
    return pico


def count_spend(books: tuple[Any, ...], slot: int, width: int, keys: int, key: int, index: int,
                cost: int | None) -> None:
    """/metrics' spend counter of (key, route target `index`): field ((key + 1) * width +
    index) * 2 (+ 1 for a request of unknown cost) of the blocks `books`; a key made at run
    time (>= keys) under no key. Nothing for a cost of 0."""
    if not books or cost == 0:
        return
    field = ((0 if key >= keys else key + 1) * width + index) * 2
    if cost is None:
        field += 1
    books[field >> _BLOCK_SHIFT].add(slot, field & _BLOCK_MASK, 1 if cost is None else cost)


def api_number(path: bytes) -> int:
    q = path.find(b"?")
    bare = path if q < 0 else path[:q]
    return API_PATHS.index(bare) if bare in API_PATHS else len(API_PATHS)


def request_id_text(value: bytes | None) -> str:
    """The ledger's request id of an x-request-id value (NUL would split the frame)."""
    if value is None:
        return ""
    return value[:ID_CHARS].decode("latin-1").replace("\0", "\ufffd")


class BookTwin:
    """velox._native.SpendBook in Python (see the module docstring)."""

    def __init__(self, books: tuple[Any, ...], slot: int, width: int, keys: int,
                 apis: tuple[bytes, ...] = API_PATHS) -> None:
        if apis != API_PATHS:
            raise ValueError("the twin knows API_PATHS only")
        self.books = books
        self.slot = slot
        self.width = width
        self.keys = keys
        self.rows_max = 0
        self.dropped = 0
        self._rows: list[tuple[int, ...]] = []
        self._ids: list[str] = []

    @property
    def rows(self) -> int:
        return len(self._rows)

    def answer(self, price: tuple[int, ...] | int | None, inp: int, out: int, cached: int,
               written: int, reasoning: int, key: int, index: int, target: int, status: int,
               t_received: int, path: bytes, request_id: bytes | None, header: bool
               ) -> tuple[int | None, tuple[bytes, bytes] | None]:
        usage = (inp, out, cached, written, reasoning)
        if any(not -_LIMIT - 1 <= v <= _LIMIT for v in usage) or \
                not NOT_BOOKED <= key <= 0x7FFFFFFF or not -1 <= index <= 1 << 24 or \
                not 0 <= target < 1 << 24:
            raise ValueError("answer: a number out of range")
        if type(price) is tuple:
            # The C sums pico-USD in 64 bits: refused where that sum (or the cost) would not fit.
            pico = _pico(price, usage) + PICO_PER_NANO // 2
            cost: int | None = pico // PICO_PER_NANO + price[5]
            if pico > _LIMIT or cost is None or cost > _LIMIT:
                raise ValueError("answer: the cost does not fit 64 bits")
        else:
            cost = price  # type: ignore[assignment]
        if key != NOT_BOOKED:
            self._book(key, index, cost)
            self._row(key, target, status, usage, cost, t_received, path, request_id)
        return cost, (COST_HEADER, usd_text(cost)) if header and cost is not None else None

    def _book(self, key: int, index: int, cost: int | None) -> None:
        if index >= 0:
            count_spend(self.books, self.slot, self.width, self.keys, key, index, cost)

    def _row(self, key: int, target: int, status: int, usage: tuple[int, ...],
             cost: int | None, t_received: int, path: bytes, request_id: bytes | None) -> None:
        if self.rows_max <= 0:
            return
        if len(self._rows) >= self.rows_max:
            self.dropped += 1
            return
        now = time.perf_counter_ns()
        label = (key + 1) << 32 | target << 8 | api_number(path)
        self._rows.append((time.time_ns() // 1_000_000, label, status, *usage,
                           NO_COST if cost is None else cost, (now - t_received) // 1000))
        self._ids.append(request_id_text(request_id))

    def take(self) -> tuple[int, bytes, list[int], bytes] | None:
        rows = self._rows
        if not rows:
            return None
        ids = "\0".join(self._ids).encode()
        self._rows, self._ids = [], []
        columns = [array("q", column) for column in zip(*rows, strict=True)]
        first: dict[int, int] = {}
        labels = columns[INT_COLUMNS.index("label")]
        for r, label in enumerate(labels):
            labels[r] = first.setdefault(label, r)
        return len(rows), b"".join(c.tobytes() for c in columns), list(first), ids
