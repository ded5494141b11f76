"""What a request cost: the price table and exact cost from a usage record.

The table is the shipped `prices.toml` (list prices, dated by its `taken` key) with the
VELOX_CONFIG file's `[[price]]` entries laid over it: an entry with the same `model` and
`upstream` replaces the shipped one, any other is added (velox.config.tables parses and
checks both).

Which entry prices a model: the most specific one that matches it,

1. one naming the request's upstream before one for every upstream,
2. an exact model name before a glob,
3. the glob with more literal characters (`gpt-4o-mini*` before `gpt-4o*`),
4. the configuration's entry before the shipped one; then the earlier one.

Money is integers. Token prices are micro-USD per million tokens (= pico-USD per token), so a
request's cost is an exact integer of pico-USD, rounded once, half up, to nano-USD
(`cost_nanos`): sums over millions of requests are exact, and the rounding is at most 0.5
nano-USD per request. Usage is read as OpenAI reports it and as the provider translators give
it: cached input and cache writes are parts of `input`, reasoning is part of `output`; each
part is billed at its own price when the entry has one, else at its parent's.

A model no entry matches has cost `None` (unknown), never 0: the ledger stores it as NULL and
reports count it apart. It is logged once per model (at most `_TOLD_MAX` models, then once
more to say that further ones are not logged).
"""

from __future__ import annotations

import fnmatch
import logging
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from velox.config.tables import (
    PRICE_FLAT_KEYS,
    PRICE_TOKEN_KEYS,
    PriceSpec,
    TableError,
    parse_prices,
)

log = logging.getLogger("velox.spend")

DEFAULT_FILE = Path(__file__).with_name("prices.toml")
_GLOB_CHARS = frozenset("*?[")
# Lookups are memoised by (upstream, model): a gateway sees few distinct pairs, and a hit
# (~0.1 us) is much cheaper than walking ~50 globs (~15 us). Cleared when full, so a client
# cycling model names costs the slow path, never unbounded memory.
_MEMO_MAX = 4096
_TOLD_MAX = 256
PICO_PER_NANO = 1000


class UsageLike(Protocol):
    """A usage record (velox.providers.base.Usage has these fields)."""

    input: int
    output: int
    cached_input: int
    cache_write: int
    reasoning: int


@dataclass(frozen=True, slots=True)
class Defaults:
    """The shipped table: its entries and the date its prices were taken."""

    prices: tuple[PriceSpec, ...]
    taken: str
    source: str


def load_defaults(path: Path = DEFAULT_FILE) -> Defaults:
    """Read the shipped table (checked by the same parser as the configuration's)."""
    source = str(path)
    data = tomllib.loads(path.read_text("utf-8"))
    taken = data.pop("taken", "")
    tables = data.pop("price", [])
    if data:
        raise TableError(f"{source}: top level: {next(iter(data))}: unknown key; valid keys: "
                         "taken, price")
    return Defaults(parse_prices(source, tables, None), str(taken), source)


def cost_nanos(price: PriceSpec, usage: UsageLike, images: int = 0) -> int:
    """The exact cost in nano-USD of one answer's usage at `price` (see the docstring)."""
    total_in = max(usage.input, 0)
    cached = min(max(usage.cached_input, 0), total_in)
    written = min(max(usage.cache_write, 0), total_in - cached)
    total_out = max(usage.output, 0)
    reasoning = min(max(usage.reasoning, 0), total_out)
    pico = ((total_in - cached - written) * price.input
            + cached * _or(price.cached_input, price.input)
            + written * _or(price.cache_write, price.input)
            + (total_out - reasoning) * price.output
            + reasoning * _or(price.reasoning, price.output))
    return (pico + PICO_PER_NANO // 2) // PICO_PER_NANO + images * price.image + price.request


def _or(value: int | None, parent: int) -> int:
    return parent if value is None else value


def _rank(spec: PriceSpec, from_file: bool, index: int) -> tuple[int, int, int, int, int]:
    """Sort key: the most specific entry first (see the module docstring)."""
    is_glob = any(c in _GLOB_CHARS for c in spec.model)
    literal = sum(c not in _GLOB_CHARS for c in spec.model)
    return (0 if spec.upstream else 1, 1 if is_glob else 0, -literal,
            0 if from_file else 1, index)


class PriceTable:
    """The effective table: defaults with the configuration's entries laid over them."""

    def __init__(self, configured: Iterable[PriceSpec] = (),
                 defaults: Defaults | None = None) -> None:
        self.defaults = defaults if defaults is not None else load_defaults()
        configured = tuple(configured)
        mine = {(p.model, p.upstream) for p in configured}
        kept = [p for p in self.defaults.prices if (p.model, p.upstream) not in mine]
        ranked = sorted([(_rank(p, True, i), p) for i, p in enumerate(configured)]
                        + [(_rank(p, False, i), p) for i, p in enumerate(kept)],
                        key=lambda pair: pair[0])
        self.entries: tuple[PriceSpec, ...] = tuple(p for _, p in ranked)
        self._memo: dict[tuple[str, str], PriceSpec | None] = {}
        self._told: set[str] = set()

    def price_for(self, upstream: str, model: str) -> PriceSpec | None:
        """The entry pricing `model` on `upstream`, or None when none matches."""
        key = (upstream, model)
        try:
            return self._memo[key]
        except KeyError:
            pass
        found = None
        for spec in self.entries:
            if (not spec.upstream or spec.upstream == upstream) and \
                    fnmatch.fnmatchcase(model, spec.model):
                found = spec
                break
        if len(self._memo) >= _MEMO_MAX:
            self._memo.clear()
        self._memo[key] = found
        return found

    def cost(self, upstream: str, model: str, usage: UsageLike, images: int = 0) -> int | None:
        """Nano-USD for `usage` of `model` on `upstream`; None (logged once) when unpriced."""
        price = self.price_for(upstream, model)
        if price is None:
            self.tell_unpriced(model)
            return None
        return cost_nanos(price, usage, images)

    def tell_unpriced(self, model: str) -> None:
        """Log once per model that it has no price."""
        told = self._told
        if model in told or len(told) > _TOLD_MAX:
            return
        told.add(model)
        if len(told) > _TOLD_MAX:
            log.warning("more models without a price; they are not logged one by one")
            return
        log.warning("no price for model %r: its requests are counted with cost unknown; add "
                    "a [[price]] table for it to VELOX_CONFIG (velox prices shows the table)",
                    model[:200])


# --- showing it (velox prices) -------------------------------------------------------------

COLUMNS = ("model", "upstream", *PRICE_TOKEN_KEYS, *PRICE_FLAT_KEYS, "source")


def describe(table: PriceTable) -> list[dict[str, object]]:
    """The effective entries, most specific first, prices in USD (per million tokens)."""
    out = []
    for spec in table.entries:
        row: dict[str, object] = {"model": spec.model, "upstream": spec.upstream or None}
        for key in PRICE_TOKEN_KEYS:
            value = getattr(spec, key)
            row[key] = None if value is None else usd(value, 6)
        for key in PRICE_FLAT_KEYS:
            row[key] = usd(getattr(spec, key), 9)
        row["source"] = "shipped" if spec.source == table.defaults.source else spec.source
        out.append(row)
    return out


def usd(units: int, decimals: int) -> float:
    """An integer of 10**-decimals USD as a float of USD (for display and JSON)."""
    return float(round(units / 10**decimals, decimals))
