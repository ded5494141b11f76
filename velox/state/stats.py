"""Shared counters and latency histograms: what the workers write and anyone can read.

One `SharedStats` is created by the supervisor before it forks, so every worker writes its own
slot (its own cache lines) of the same shared mapping, and the supervisor or any reader sums
the slots without asking the workers anything. Field meanings are fixed in velox.core.fields;
the native `Counters` and `Histogram` know only numbers.
"""

from __future__ import annotations

from typing import Any

from velox._native import Counters as Counters  # re-exported: the type the stages count with
from velox._native import Histogram
from velox.config.tables import DEFAULT_UPSTREAM, Tables, UpstreamSpec, single_upstream
from velox.core.fields import (
    KIND_FIELDS,
    OTHER_KEYS,
    RETRY_REASONS,
    TOKEN_BLOCK,
    UPSTREAM_CLASSES,
    F,
    H,
)
from velox.state.health import SharedHealth
from velox.state.keys import SharedKeys


def _blocks(slots: int, size: int) -> tuple[Any, ...]:
    """`size` fields a slot as Counters of at most TOKEN_BLOCK fields (a row's limit): field f
    is block f // TOKEN_BLOCK."""
    return tuple(Counters(slots, min(TOKEN_BLOCK, size - start))
                 for start in range(0, size, TOKEN_BLOCK))


class SharedStats:
    """Everything the workers write and the admin reads, mapped before the workers fork.

    Beside the per-worker counters and latency histograms: the upstreams' shared live state
    (`health`: breakers, in-flight gauges, the retry budget), one upstream-latency histogram
    per upstream, the picks of every route target (`targets`, field = the target's position in
    `target_names`) and retries by reason.

    Worker slots: there are 2 x `workers` of them (`slots`), so that during a reload the old
    and the new worker of logical slot i run side by side in slots i and i + workers without
    sharing a gauge. `active` (one shared row, field = slot) says which slots make up the
    serving set: readiness, the hang watch and the per-worker gauges of /stats and /metrics
    look only at those. Counters and histograms sum over every slot, so they stay cumulative
    across reloads. `with_tables()` makes the shared state of a new configuration.
    """

    __slots__ = ("workers", "slots", "active", "counters", "histograms", "routes", "tables",
                 "health", "upstream_latency", "targets", "target_names", "retries",
                 "upstream_status", "cache", "keys", "tokens", "key_names", "route_models",
                 "spend")

    def __init__(self, workers: int, tables: Tables | None = None) -> None:
        self.workers = workers
        self.slots = slots = 2 * workers
        self.active = Counters(1, slots)
        for slot in range(workers):
            self.active.set(0, slot, 1)
        self.counters = Counters(slots, len(F))
        self.histograms = tuple(Histogram(slots) for _ in H)
        self.routes = Counters(slots, KIND_FIELDS)
        self.retries = Counters(slots, len(RETRY_REASONS))
        # The response cache's shared store (velox.cache.front.create_store), set by the supervisor
        # before it forks when caching is on anywhere; None otherwise.
        self.cache: Any = None
        self._per_upstream(tables)

    def _per_upstream(self, tables: Tables | None, keys: SharedKeys | None = None) -> None:
        if tables is None:
            tables = single_upstream(UpstreamSpec(DEFAULT_UPSTREAM, "https://api.openai.com"))
        slots = self.slots
        self.tables = tables
        self.health = SharedHealth.create(tables)
        self.upstream_latency = tuple(Histogram(slots) for _ in tables.upstreams)
        self.target_names = tuple((route.model, target.upstream)
                                  for route in tables.routes for target in route.targets)
        self.targets = Counters(slots, max(1, len(self.target_names)))
        self.upstream_status = Counters(slots, len(tables.upstreams) * len(UPSTREAM_CLASSES))
        # The [[key]] limits: kept across a reload that keeps the same key names
        # (velox.admission.keys).
        self.keys = SharedKeys(tables.keys, slots, keys)
        # Tokens by gateway key and route (velox.relay.usage.Ledger writes them): field =
        # ((key + 1) x routes + route) x 2 + kind (0 input, 1 output); key -1 is "no key".
        self.key_names = ("-", *tuple(k.name for k in tables.keys))
        self.route_models = tuple(r.model for r in tables.routes)
        # Counters hold at most TOKEN_BLOCK fields a row: field f is tokens[f // TOKEN_BLOCK].
        size = max(1, len(self.key_names) * len(self.route_models) * 2)
        self.tokens = _blocks(slots, size)
        # Spend by gateway key and route target (velox.spend.wire writes it): field =
        # ((key + 1) x targets + target) x 2 + kind (0 nano-USD, 1 requests of unknown cost).
        self.spend = _blocks(slots, max(1, len(self.key_names) * len(self.target_names) * 2))

    def with_tables(self, tables: Tables) -> SharedStats:
        """The shared state for a reloaded configuration; call it before forking its workers.

        Shares this one's slot mask, worker counters, histograms, routes and retries (they are
        cumulative and indexed by nothing the tables decide); makes new per-upstream parts
        (health, upstream latency and status, target picks), which are indexed by the
        upstreams' and targets' positions in the new tables, so they start from zero.
        """
        new = object.__new__(SharedStats)
        for name in ("workers", "slots", "active", "counters", "histograms", "routes",
                     "retries", "cache"):
            setattr(new, name, getattr(self, name))
        new._per_upstream(tables, self.keys)
        return new

    def forget_slot(self, slot: int) -> None:
        """The worker of `slot` died (SIGKILL, crash): give back the shared places it held."""
        self.keys.forget_slot(slot)

    def is_active(self, slot: int) -> bool:
        return bool(self.active.get(0, slot))

    def active_slots(self) -> list[int]:
        row = self.active.snapshot()[0]
        return [slot for slot in range(self.slots) if row[slot]]

    def all_ready(self) -> bool:
        counters = self.counters
        return all(counters.get(slot, F.READY) for slot in self.active_slots())

    def token_rows(self, own_keys: int | None = None) -> list[tuple[str, str, int, int]]:
        """(key, route, input, output) for every key and route that used tokens. With
        `own_keys`, keys past the first `own_keys` (file order) are summed per route under
        OTHER_KEYS (the no-key row '-' is always its own)."""
        return [(key, self.route_models[r], inp, out)
                for key, r, inp, out in self._by_key(self.tokens, len(self.route_models),
                                                     own_keys)]

    def spend_rows(self, own_keys: int | None = None) -> list[tuple[str, int, int, int]]:
        """(key, target, nano-USD, requests of unknown cost) for every key and route target
        (its position in `target_names`) that spent; `own_keys` as in token_rows."""
        return self._by_key(self.spend, len(self.target_names), own_keys)

    def _by_key(self, blocks: tuple[Any, ...], width: int,
                own_keys: int | None) -> list[tuple[str, int, int, int]]:
        """The non-zero pairs of fields ((key + 1) x width + column) x 2 + {0, 1} of `blocks`,
        summed over the slots, keys past `own_keys` summed under OTHER_KEYS."""
        totals = [n for block in blocks for n in block.totals()]
        names = self.key_names if own_keys is None else self.key_names[:own_keys + 1]
        rows = []
        for k, key in enumerate(names):
            for c in range(width):
                field = (k * width + c) * 2
                if totals[field] or totals[field + 1]:
                    rows.append((key, c, totals[field], totals[field + 1]))
        if len(names) < len(self.key_names):
            start = len(names) * width * 2
            for c in range(width):
                first = sum(totals[start + c * 2::width * 2])
                second = sum(totals[start + c * 2 + 1::width * 2])
                if first or second:
                    rows.append((OTHER_KEYS, c, first, second))
        return rows

    def totals(self) -> dict[str, int]:
        totals = self.counters.totals()
        return {f.name.lower(): totals[f] for f in F}
