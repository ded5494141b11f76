"""Spend on the request path: each model call priced, budgets held, one ledger row per request.

Three narrow call sites in the worker, so they can move into a request's single end when the
lifecycle has one:

* `Spend.run(batch)` after the keys stage: a request of a key under a budget (its own
  `budget_usd`, or a `[[budget]]` team it is in) reserves its estimated cost, or is refused with
  429 `insufficient_quota` when a budget has nothing left.
* The worker meters a model call with one of `Spend.meters`, token meters that also price
  (`PricedMeter`): a non-streamed answer is priced from its body before it is written (so
  it carries `x-velox-cost-usd`); every request is priced again, from its final usage, when
  it ends, settles its reservation to that exact cost and appends its ledger row.
* `Spend.answered(request)` from the worker's on_response: a request answered without an
  exchange (refused, cache hit) gives its reservation back whole.

Budgets in shared memory (`SharedBudgets`, made by the supervisor before the workers fork):
each budget is one bucket of a native `Limits`, as a key's tpm is, counting units of the
budget (1 micro-USD; coarser above $1,000). Admission reads its level (one native call); a
request is admitted while anything is left and takes its estimate (into debt when less is
left); settlement charges or refunds the difference to its exact cost. So the spend goes past
a budget by at most what the requests admitted before it ran out cost beyond what was left:
the requests in flight at that moment, plus one request per worker admitted in the instant
between another's check and its take. Per worker slot the units its requests in flight
reserve are counted too, so a killed worker's reservations go back when its slot restarts.
At start the buckets are filled with the budget less what the ledger says was spent in the
current period: a restart resumes from it. With VELOX_REDIS_URL they hold instead the
allowances the host leases from Redis, within what every host used (velox.spend.hosts).

Periods are calendar periods in UTC (`day`, `week` from Monday, `month`, or `total`); the
supervisor notices a new one within 0.2 s and fills the bucket whole again (`roll`).

What is not priced: a model without a price (cost unknown, logged once per model: it is never
counted as 0, and it reserves nothing, so a budget cannot stop it). Embeddings merged by the
batching stage are priced per member, from its share of the merged call's usage (`member`);
the merged call has no row of its own. Cached input, cache writes and reasoning are priced
apart whenever the answer reports them: a plain answer's usage, a stream's usage events
(OpenAI's usage chunk, a responses stream's last event, Anthropic's message_start and
message_delta), or a translated stream's usage told by the translator (`told`).
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from velox.config.tables import BudgetSpec, PriceSpec, Tables
from velox.core.errors import InsufficientQuota
from velox.core.types import Kind, Request
from velox.providers.anthropic import usage_of as anthropic_usage
from velox.relay import usage as relay_usage  # its scans, read at call time (relay_usage.use)
from velox.relay.usage import TokenMeter
from velox.spend.book import (
    API_NAMES,
    API_PATHS,
    BookTwin,
    SpendBook,
    cost_of,
    count_spend,
    label_parts,
    price_record,
)
from velox.spend.gate import NANOS_PER_USD, BudgetGate, GateTwin, usd_text
from velox.spend.ledger import Store, connect, period_start, state_file
from velox.spend.prices import PICO_PER_NANO, PriceTable, UsageLike
from velox.spend.rowframe import pack_columns
from velox.state.limits import Limits
from velox.state.stats import Counters

log = logging.getLogger("velox.spend")

# A budget's bucket counts micro-USD, or coarser units for a budget above $1,000: a native
# bucket holds at most 10**9 tokens. A settlement's remainder below one unit is carried by the
# worker to its next settlement, so the charges add up to the exact costs.
_UNIT_NANOS = 1000
_MAX_TOKENS = 10**9
_MAX_BUDGETS = 4096  # the slots' reservation counters: a Counters row holds 4,096 fields
COST_HEADER = b"x-velox-cost-usd"
REMAINING_HEADER = b"x-velox-budget-remaining-usd"
_NO_RETRY = ((b"x-should-retry", b"false"),)
_MODEL_CALL = Kind.MODEL_CALL
# A non-zero cached, cache-write or reasoning count (OpenAI's names, a translated answer's
# cache_write_tokens, Anthropic's cache_*_input_tokens): only then is the body parsed for its
# parts (OpenAI sends both members, as 0, in nearly every answer; a parse costs ~2 us, the
# search ~0.3).
_DETAILS = re.compile(rb'"(?:cached|reasoning|thinking|cache_write|cache_read_input'
                      rb'|cache_creation_input)_tokens"\s*:\s*[1-9]')
# A usage object that reports no part, byte for byte as OpenAI writes it (its details, when
# present, with cached_tokens and reasoning_tokens 0); anything else takes _DETAILS' search.
_ZERO_PARTS = re.compile(
    rb'"usage":\{"prompt_tokens":\d+,"completion_tokens":\d+,"total_tokens":\d+'
    rb'(?:,"prompt_tokens_details":\{"cached_tokens":0,"audio_tokens":\d+\},'
    rb'"completion_tokens_details":\{"reasoning_tokens":0,"audio_tokens":\d+,'
    rb'"accepted_prediction_tokens":\d+,"rejected_prediction_tokens":\d+\})?\}')


def period_number(period: str, now_s: float) -> int:
    """Which UTC calendar period `now_s` is in, as a number that grows with time."""
    if period == "total":
        return 0
    days = int(now_s // 86_400)
    if period == "day":
        return days
    if period == "week":
        return (days + 3) // 7  # 1970-01-01 was a Thursday: weeks start on Mondays
    today = dt.datetime.fromtimestamp(now_s, dt.UTC)
    return today.year * 12 + today.month - 1


@dataclass(frozen=True, slots=True)
class Budget:
    name: str  # a key's name, or a [[budget]]'s
    team: bool
    nanos: int
    period: str


def budgets_of(tables: Tables) -> tuple[Budget, ...]:
    """Every budget: the keys' own (in file order), then the teams'."""
    own = [Budget(k.name, False, k.budget_nanos, k.budget_period)
           for k in tables.keys if k.budget_nanos]
    teams = [Budget(b.name, True, b.budget_nanos, b.period) for b in tables.budgets]
    return tuple(own + teams)


class SharedBudgets:
    """The budgets in shared memory (see the module docstring); made before fork.

    Each budget is one bucket of a native `Limits` (velox.state.limits), as a key's tpm is:
    admission and settlement are a few native calls, whatever the number of workers. The
    bucket's tokens are UNITS of the budget: 1 micro-USD, or budget / 10**9 for a budget above
    $1,000 (a bucket holds at most 10**9 tokens). It is a leased bucket (rate 0): only `give`
    fills it, with the whole budget when a period starts (`roll`, run by the supervisor) less
    what the ledger says was spent in it (`resume`, at start). Beside it, per worker slot,
    the units its requests in flight reserve, so the slot's next worker gives back what a
    killed one held (`start_slot`).
    """

    def __init__(self, tables: Tables, slots: int, ledger_file: str = "",
                 now_s: float | None = None, leased: bool = False) -> None:
        self.budgets = budgets_of(tables)
        n = len(self.budgets)
        if n > _MAX_BUDGETS:
            raise ValueError(f"at most {_MAX_BUDGETS} budgets ([[key]] budget_usd and "
                             f"[[budget]] tables together), got {n}")
        self.slots = slots
        self.limits = Limits(max(1, n), slots)
        # Nano-USD per token of each budget's bucket, and the bucket's size in tokens.
        self.units = tuple(max(_UNIT_NANOS, -(-b.nanos // _MAX_TOKENS)) for b in self.budgets)
        self.sizes = tuple(max(1, b.nanos // u) for b, u in zip(self.budgets, self.units,
                                                                 strict=True))
        self.in_flight = Counters(slots, max(1, n))  # per slot and budget: units reserved
        now_s = time.time() if now_s is None else now_s
        self.periods = [period_number(b.period, now_s) for b in self.budgets]
        spent = self.resume(ledger_file, now_s) if ledger_file else {}
        # Units this host spent in each budget's current period before it started (its own
        # ledger: across hosts, what it re-sends to Redis, velox.spend.hosts).
        self.base = [-(-spent.get(b, 0) // u) for b, u in enumerate(self.units)]
        # Across hosts (VELOX_REDIS_URL): the buckets hold only the allowances the refresher
        # leases from Redis (velox.spend.hosts), which also rolls the periods; `across` is, per
        # budget, what Redis said was left unallocated across the hosts at its last call.
        self.leased = leased
        self.across = Counters(1, max(1, n))
        for b, size in enumerate(self.sizes):
            self.limits.configure(b, 0, size)  # leased: empty until given
            left = size - self.base[b]
            if left > 0 and not leased:
                self.limits.give(b, left)
            self.across.set(0, b, max(0, left))

    def resume(self, ledger_file: str, now_s: float) -> dict[int, int]:
        """Nano-USD the ledger holds for each budget's current period (a restart goes on
        from there, not from zero)."""
        try:
            store = Store(connect(ledger_file, readonly=True))
        except Exception:  # no file yet (first start): nothing was spent
            return {}
        try:
            now_ms = int(now_s * 1000)
            out = {}
            for b, budget in enumerate(self.budgets):
                since = period_start(budget.period, now_ms)
                spent = store.spent("team" if budget.team else "key", since).get(budget.name)
                out[b] = spent.cost_nanos if spent else 0
            return out
        finally:
            store.conn.close()

    def start_slot(self, slot: int) -> None:
        """A worker starts in `slot`: what a killed predecessor still reserved goes back (its
        spend stays)."""
        in_flight = self.in_flight
        for b in range(len(self.budgets)):
            held = in_flight.get(slot, b)
            if held:
                self.limits.refund(b, held)
                in_flight.set(slot, b, 0)

    def roll(self, now_s: float) -> list[int]:
        """A new period began for some budgets: each is filled whole again (the give is capped
        at its size; requests in flight at the change stay charged to the old period with
        their reservations, only the difference to their exact cost goes to the new one).
        Run by the supervisor only (on its 0.2 s wake-up), so a period starts once. Returns
        the budgets rolled."""
        rolled: list[int] = []
        if self.leased:  # across hosts the refresher rolls them (velox.spend.hosts)
            return rolled
        for b, budget in enumerate(self.budgets):
            number = period_number(budget.period, now_s)
            if number != self.periods[b]:
                self.periods[b] = number
                self.limits.give(b, self.sizes[b])
                rolled.append(b)
        return rolled

    def left(self, b: int) -> int:
        """Nano-USD left in budget `b` now (negative: spent past it)."""
        return self.limits.level(b) * self.units[b]

    def used(self, b: int) -> int:
        """Spent in the current period plus reserved by the requests in flight, nano-USD
        (across hosts: plus what the other hosts hold, as Redis last said)."""
        level = self.limits.level(b)
        if self.leased:
            level = max(0, level) + self.across.get(0, b)
        return (self.sizes[b] - level) * self.units[b]

    def may_borrow(self, b: int, left: int, estimate: int) -> bool:
        """Across hosts, a request finding this host's allowance used up (`left` <= 0, nano-USD)
        is admitted all the same, into debt, while the debt is under one request's estimate and
        Redis last said at least that much was left unallocated: a host's first request, or
        one after an idle spell, does not wait for a lease (the next grant pays the debt)."""
        return estimate > 0 and left > -estimate and self.unallocated(b) >= estimate

    def unallocated(self, b: int) -> int:
        """Across hosts: nano-USD of budget `b` no host holds nor spent, at Redis's last call."""
        return self.across.get(0, b) * self.units[b]

    def reserved(self, b: int) -> int:
        """What the requests in flight reserve from budget `b`, every slot (a refusal's
        message: not on the admission path)."""
        return self.in_flight.totals()[b] * self.units[b]

    def snapshot(self) -> list[dict[str, Any]]:
        return [{"name": b.name, "team": b.team, "period": b.period,
                 "budget_usd": b.nanos / NANOS_PER_USD, "used_usd": self.used(i) / NANOS_PER_USD}
                for i, b in enumerate(self.budgets)]


# What an admitted request of a budgeted key holds until it ends: its budgets (indexes into
# SharedBudgets) and its estimate (nano-USD), from which each budget's reservation follows.
_Hold = tuple[tuple[int, ...], int]
_UNSEEN: Any = object()
_MEMO_MAX = 4096
# The route target that answered, as priced: (upstream model, upstream name, its price, the
# route's model, the price as the native book reads it (velox.spend.book.PRICE_FIELDS), its
# number in the ledger rows' labels, its index in the stats' targets or -1).
_Target = tuple[str, str, PriceSpec | None, str, tuple[int, ...] | None, int, int]
# Target numbers (a label's middle 24 bits) in use at most before they start again, after the
# rows kept are shipped: a `*` route's client cycling model names cannot grow them without
# bound. A request in flight across that reset (once per 65,536 distinct targets) may have its
# row labelled with the new owner of its number.
_NUMBERS_MAX = 1 << 16
_FREE = (0, 0, -1, -1, -1, 0)  # a request that used nothing costs nothing, priced or not


class Spend:
    """Per worker: pricing, the budgets' admission and settlement, the ledger rows."""

    def __init__(self, tables: Tables, shared: SharedBudgets | None, slot: int,
                 default_output: int, books: tuple[Any, ...] = (), native: bool = True) -> None:
        self.prices = PriceTable(tables.prices)
        # /metrics' spend counters (velox.state.stats.SharedStats.spend; none: not counted).
        self.books = books
        self.book_width = sum(len(r.targets) for r in tables.routes)
        self.book_keys = len(tables.keys)
        self.shared = shared
        self.slot = slot
        self.default_output = default_output
        # Cost, cost header, /metrics' counter and ledger row of an answer in one native call
        # (velox.spend.book); its rows kept only once a ledger feed is set (`feed`). VELOX_NATIVE=0:
        # its Python twin, the same costs, headers, counters and rows.
        self.priced: SpendBook | BookTwin = (SpendBook if native else BookTwin)(
            tuple(books), slot, self.book_width, self.book_keys, API_PATHS)
        self._feed: Any = None
        self._dropped = 0  # the book's dropped rows already added to the feed's count
        self.key_names = tuple(k.name for k in tables.keys)
        index = {b.name if not b.team else "\0" + b.name: i
                 for i, b in enumerate(shared.budgets if shared is not None else ())}
        teams: dict[str, list[BudgetSpec]] = {k.name: [] for k in tables.keys}
        for team in tables.budgets:
            for member in team.keys:
                teams[member].append(team)
        self.team_of = tuple(teams[k.name][0].name if teams[k.name] else "" for k in tables.keys)
        # Per key: the budgets it is under (its own first), as indexes into `shared` (none
        # without it: a worker run without a supervisor, as the benchmarks do).
        self.key_budgets: tuple[tuple[int, ...], ...] = tuple(
            tuple(([index[k.name]] if k.budget_nanos else [])
                  + [index["\0" + t.name] for t in teams[k.name]]) if shared is not None
            else () for k in tables.keys)
        self.budgets = shared.budgets if shared is not None else ()
        # Admitted requests of budgeted keys until their exchange (or answer): their budgets
        # and estimates (velox.spend.wire.SharedBudgets).
        self.held: dict[Request, _Hold] = {}
        # Admission and settlement, one native call each (velox.spend.gate); across hosts the
        # admission's steps in Python (it also asks what Redis said), the twin's.
        self.gate: BudgetGate | GateTwin | None = None
        self.twin: GateTwin | None = None
        if shared is not None:
            if shared.leased:
                self.gate = self.twin = GateTwin(shared.limits, shared.in_flight,
                                                 shared.units, slot)
            else:
                self.gate = BudgetGate(shared.limits, shared.in_flight, shared.units, slot)
        # Where a route sends first: (upstream, upstream model) to price an estimate with.
        self._first = {r.model: (r.targets[0].upstream, r.targets[0].model)
                       for r in tables.routes}
        self._catch_all = self._first.get("*")
        # Per requested model: the price of the target it goes to first (`estimate`).
        self._first_price: dict[str, PriceSpec | None] = {}
        # Per route target (its index in the stats' targets): what `target` resolved.
        self._targets: dict[int, _Target] = {}
        # The targets' numbers in the rows' labels: (model, upstream, route) by number.
        self._numbers: dict[tuple[str, str, str], int] = {}
        self._named: list[tuple[str, str, str]] = []
        # The meters the worker makes for model calls (plain and streamed, reported-only).
        self.meters = (_bound(PricedMeter, self), _bound(PricedReported, self))

    # --- admission ------------------------------------------------------------------------

    def run(self, requests: list[Request]) -> list[Request]:
        """Reserve the estimated cost of each budgeted request; refuse those whose budget is
        spent (429 insufficient_quota). Requests of no budget pass untouched."""
        key_budgets = self.key_budgets
        n_file = self.book_keys
        gate, twin, held = self.gate, self.twin, self.held
        out: list[Request] = []
        for request in requests:
            k = request.key
            if k < 0 or k >= n_file or not key_budgets[k]:  # no budget (run-time keys: none)
                out.append(request)
                continue
            budgets = key_budgets[k]
            if twin is not None:
                if self._admit_leased(request, budgets, twin):
                    out.append(request)
                continue
            estimate = self.estimate(request)
            left = gate.admit(budgets, estimate)  # type: ignore[union-attr]
            if type(left) is int:  # the budget with nothing left
                self._refuse(request, self.budgets[left])
                continue
            held[request] = (budgets, estimate)
            # What the tightest budget had left when this request was admitted (before its
            # cost).
            _add_header(request, REMAINING_HEADER, left)  # type: ignore[arg-type]
            out.append(request)
        return out

    def _admit_leased(self, request: Request, budgets: tuple[int, ...], twin: GateTwin) -> bool:
        """Across hosts (velox.spend.hosts): a budget whose allowance here is used up may lend
        one estimate while Redis last said that much was left unallocated."""
        shared = self.shared
        assert shared is not None
        level, units = shared.limits.level, shared.units  # SharedBudgets.left, inlined
        lowest = -1
        estimate = -1  # computed once, when needed
        for b in budgets:
            here = level(b) * units[b]
            if here <= 0:
                if estimate < 0:
                    estimate = self.estimate(request)
                if not shared.may_borrow(b, here, estimate):
                    # A refused take: the refresher counts it as demand.
                    shared.limits.take(b, max(1, -(-estimate // units[b])))
                    self._refuse(request, self.budgets[b])
                    return False
            here += shared.unallocated(b)
            if lowest < 0 or here < lowest:
                lowest = here
        if estimate < 0:
            estimate = self.estimate(request)
        if estimate > 0:
            for b in budgets:
                twin.reserve(b, -(-estimate // units[b]))
        self.held[request] = (budgets, estimate)
        _add_header(request, REMAINING_HEADER, usd_text(lowest))
        return True

    def estimate(self, request: Request) -> int:
        """Nano-USD a model call may cost: its estimated input and output (velox.relay.usage's
        rule: body bytes / 4, max_*tokens or VELOX_TOKENS_DEFAULT_OUTPUT) at its first
        target's price; 0 when it has no price or is no model call."""
        if request.kind is not _MODEL_CALL:
            return 0
        model = request.model or ""
        price = self._first_price.get(model, _UNSEEN)
        if price is _UNSEEN:
            price = self._first_price_of(model)
        if price is None:
            return 0
        inp, out = relay_usage.estimate_scan(request.body)
        return plain_cost(price, inp, out if out >= 0 else self.default_output)

    def _first_price_of(self, model: str) -> PriceSpec | None:
        """The price of the target a request for `model` goes to first, kept per model (a
        catch-all route's models too, up to _MEMO_MAX of them)."""
        first = self._first.get(model, self._catch_all)
        price = None if first is None else self.prices.price_for(first[0], first[1] or model)
        if len(self._first_price) >= _MEMO_MAX:
            self._first_price.clear()
        self._first_price[model] = price
        return price

    def _refuse(self, request: Request, budget: Budget) -> None:
        """429 insufficient_quota. Spent: final for the period (x-should-retry: false keeps
        the SDKs from retrying). Not spent, but what is left is reserved by requests in
        flight (each reserves its estimate, which without max_tokens assumes
        VELOX_TOKENS_DEFAULT_OUTPUT): the same error, saying so, with Retry-After 1."""
        ticket = request.ticket
        if ticket is not None:  # the key stage's tokens: nothing was used (its place goes
            ticket.settle(0)  # back at the request's end, Worker.finished)
        what = f"team budget {budget.name!r}" if budget.team else \
            f"budget of gateway key {budget.name!r}"
        period = "in total" if budget.period == "total" else f"this {budget.period} (UTC)"
        limit = f"{usd_text(budget.nanos).decode()} USD {period}"
        shared = self.shared
        b = self.budgets.index(budget)
        reserved = shared.reserved(b) if shared is not None else 0
        spent = shared.used(b) - reserved if shared is not None else budget.nanos
        if shared is not None and shared.leased and shared.unallocated(b) > 0:
            # Across hosts: this host's allowance is used up, more is left in Redis; the
            # refresher leases it within a tick (0.05 s) when the budget still has it.
            error = InsufficientQuota(
                f"The {what} ({limit}) is shared by several gateways: this one's allowance is "
                f"used up and {usd_text(shared.unallocated(b)).decode()} USD is left across "
                "them; retry in a second.", retry_after_s=1,
                headers=((REMAINING_HEADER, b"0"),))
        elif spent >= budget.nanos or reserved <= 0:
            error = InsufficientQuota(f"The {what} is spent: {limit}.",
                                      headers=(*_NO_RETRY, (REMAINING_HEADER, b"0")))
        else:
            error = InsufficientQuota(
                f"The {what} ({limit}) is held by requests in flight: "
                f"{usd_text(reserved).decode()} USD reserved by their estimates, "
                f"{usd_text(max(0, spent)).decode()} USD spent; retry when they finish "
                "(max_tokens makes a request's estimate smaller).", retry_after_s=1,
                headers=((REMAINING_HEADER, b"0"),))
        request.conn.respond_error(request, error)

    # --- settlement -----------------------------------------------------------------------

    def answered(self, request: Request) -> None:
        """The request was answered without a priced exchange: its reservation goes back."""
        hold = self.held.pop(request, None)
        if hold is not None:
            self._settle(hold, 0)

    def sweep(self) -> None:
        """Give back the reservations of requests whose client left before they got an
        exchange or an answer (queued behind an identical request, or in the batcher): no
        other end of theirs is seen here. Run on the worker's tick; the map holds only the
        requests between admission and their exchange, so it is short."""
        for request in [r for r in self.held if r.conn.closed and r.exchange is None]:
            self.answered(request)

    def _settle(self, hold: _Hold, cost: int) -> None:
        """The request's reservations become its cost, in each budget's units (the part
        below a unit carried to this worker's next settlement)."""
        gate = self.gate
        assert gate is not None
        gate.settle(hold[0], hold[1], cost)

    def target(self, exchange: Any) -> _Target:
        """(model, upstream, price, route, price record, number, index) of the route target
        that answered `exchange` (_Target),
        resolved at its first answer and kept per target: a target's upstream, model and
        route are fixed, but for a `*` route's target naming no model, kept while the
        request's model is the same (one dict lookup a request instead of three calls,
        ~0.3 us)."""
        routing = exchange.routing
        attempt = routing.attempt
        model = attempt.model if attempt is not None and attempt.model else \
            exchange.request.model or ""
        index = attempt.index if attempt is not None else -1
        hit = self._targets.get(index)
        if hit is None or hit[0] != model:
            upstream = _name(routing.upstream_name)
            route = attempt.route.model if attempt is not None else model
            price = self.prices.price_for(upstream, model)
            if price is None:
                self.prices.tell_unpriced(model)
            hit = (model, upstream, price, route, price_record(price),
                   self._number(model, upstream, route), index)
            if index >= 0:
                self._targets[index] = hit
        return hit

    def _number(self, model: str, upstream: str, route: str) -> int:
        """The target's number in the ledger rows' labels."""
        named = (model, upstream, route)
        number = self._numbers.get(named)
        if number is None:
            if len(self._named) >= _NUMBERS_MAX:  # start again, the rows kept shipped first
                if self._feed is not None:
                    self._feed.flush()
                self._numbers.clear()
                self._named.clear()
                self._targets.clear()
            number = self._numbers[named] = len(self._named)
            self._named.append(named)
        return number

    @property
    def feed(self) -> Any:
        """The worker's ledger feed (velox.admin.ledgerfeed.LedgerFeed, set by the agent;
        None: no ledger): the book keeps rows for it, which its flush takes (`take`)."""
        return self._feed

    @feed.setter
    def feed(self, feed: Any) -> None:
        self._feed = feed
        self.priced.rows_max = 0 if feed is None else feed.rows_max
        if feed is not None:
            feed.source = self.take
            feed.source_rows = self.kept

    def kept(self) -> int:
        """Rows the book holds for the feed's next flush."""
        return int(self.priced.rows)

    def take(self) -> tuple[bytes, int, int] | None:
        """The rows the book kept since the last call, as one ledger frame (rowframe):
        (frame body, rows, rows dropped since the last call), None when there is nothing."""
        book = self.priced
        dropped, self._dropped = book.dropped - self._dropped, book.dropped
        taken = book.take()
        if taken is None:
            return (b"", 0, dropped) if dropped else None
        rows, ints, labels, ids = taken
        names, teams, n_file, named = self.key_names, self.team_of, self.book_keys, self._named
        out = []
        for label in labels:
            k, number, api = label_parts(label)
            model, upstream, route = named[number]
            out.append((names[k] if 0 <= k < len(names) else "",
                        teams[k] if 0 <= k < n_file else "", route, upstream, model,
                        API_NAMES[api]))
        return pack_columns(rows, ints, out, ids), rows, dropped

    def answer(self, target: _Target, usage: tuple[int, int, int, int, int], key: int,
               status: int, request: Request, exchange: Any, header: bool
               ) -> tuple[int | None, tuple[bytes, bytes] | None]:
        """One answer priced, counted and its ledger row kept (the native book's one call;
        the meters make it inline on the plain answer's path)."""
        try:
            # target[4], [6], [5]: its price record, stats index and label number (_Target)
            return self.priced.answer(target[4], *usage, key, target[6], target[5], status,
                                    request.t_received, request.upstream_path,
                                    exchange.request_id, header)
        except ValueError:
            return self.overflow(target, usage, header)

    def overflow(self, target: _Target, usage: tuple[int, int, int, int, int], header: bool
                 ) -> tuple[int | None, tuple[bytes, bytes] | None]:
        """A usage past 64 bits (no upstream reports one): priced in Python, for the answer's
        header and the budget; no counter and no ledger row take a number that large."""
        record = target[4]
        cost = None if record is None else cost_of(record, usage)
        return cost, (COST_HEADER, usd_text(cost)) if header and cost is not None else None

    def book(self, attempt: Any, key: int, cost: int | None) -> None:
        """Count the cost (or one request of unknown cost) in /metrics' shared counters, under
        the key and the route target that answered (see SharedStats.spend); the priced
        answers count theirs in their one call (`answer`), this is the same count alone."""
        if attempt is not None and attempt.index >= 0:
            count_spend(self.books, self.slot, self.book_width, self.book_keys, key,
                        attempt.index, cost)

    def member(self, request: Request, inp: int, out: int, exchange: Any) -> None:
        """A batched embeddings request, answered its share of a merged call's usage
        (velox.batching.batch): priced as if it had called alone (x-velox-cost-usd, its
        budget settled, its ledger row, /metrics); the merged call itself is not (finish)."""
        target = self.target(exchange)
        cost, header = self.answer(target, (inp, out, 0, 0, 0), request.key, 200, request,
                                   exchange, True)
        if header is not None:
            _add_header(request, *header)
            share = getattr(request.exchange, "meter", None)  # the Member's Share
            if share is not None:
                share.cost = cost  # the access log's cost_usd (velox.relay.records)
        hold = self.held.pop(request, None)
        if hold is not None:
            self._settle(hold, cost or 0)


def plain_cost(price: PriceSpec, inp: int, out: int) -> int:
    """cost_nanos of a usage without cached, cache-write or reasoning parts (the common
    case, ~0.3 us instead of ~1)."""
    pico = (inp if inp > 0 else 0) * price.input + (out if out > 0 else 0) * price.output
    return (pico + PICO_PER_NANO // 2) // PICO_PER_NANO + price.request


class _Usage:
    """A usage record (velox.spend.prices.UsageLike)."""

    __slots__ = ("input", "output", "cached_input", "cache_write", "reasoning")

    def __init__(self, inp: int, out: int, cached: int = 0, written: int = 0,
                 reasoning: int = 0) -> None:
        self.input = inp
        self.output = out
        self.cached_input = cached
        self.cache_write = written
        self.reasoning = reasoning


def _parts(data: Sequence[bytes]) -> _Usage | None:
    """The usage, with its cached, cache-write and reasoning parts, that the usage objects of
    `data` (JSON documents: an answer, or a stream's usage events, later ones over earlier
    ones) report; None when they report no such part (then the token meter's two numbers are
    the whole usage)."""
    for d in data:  # a loop, not any(): this runs for every answer
        # From the last "usage" key on (the usage object, as usage_of reads it), not over the
        # whole answer: a 10 KB answer's search was ~3 us, its usage object's ~0.2.
        # OpenAI's usage object as it writes it, its two parts 0 (nearly every answer): one
        # anchored match (~0.2 us) instead of the search, which walks all of it (~0.6).
        at = max(0, d.rfind(b'"usage"'))
        if _ZERO_PARTS.match(d, at) is None and _DETAILS.search(d, at) is not None:
            break
    else:
        return None
    found: dict[str, Any] = {}
    for d in data:
        try:
            doc = orjson.loads(d)
        except orjson.JSONDecodeError:
            return None
        if type(doc) is not dict:
            return None
        one = doc.get("usage")
        if one is None:  # a Messages stream's message_start, a responses stream's event
            inner = doc.get("message") if type(doc.get("message")) is dict else doc.get("response")
            one = inner.get("usage") if type(inner) is dict else None
        if type(one) is dict:
            found.update(one)
    return usage_parts(found)


def usage_parts(found: dict[str, Any]) -> _Usage | None:
    """A usage object of any shape a client API reports, in OpenAI's terms (cached input and
    cache writes parts of the input, reasoning part of the output): chat completions
    (prompt_tokens, *_details; a translated answer adds cache_write_tokens), responses
    (input_tokens, input_tokens_details, output_tokens_details) and Anthropic Messages
    (input_tokens beside cache_read_input_tokens and cache_creation_input_tokens)."""
    if "cache_read_input_tokens" in found or "cache_creation_input_tokens" in found:
        parts = anthropic_usage(found)
        return _Usage(parts.input, parts.output, parts.cached_input, parts.cache_write,
                      parts.reasoning)
    inp, out = found.get("prompt_tokens"), found.get("completion_tokens")
    into = found.get("prompt_tokens_details") or {}
    outof = found.get("completion_tokens_details") or {}
    if inp is None:
        inp, out = found.get("input_tokens"), found.get("output_tokens")
        into = found.get("input_tokens_details") or {}
        outof = found.get("output_tokens_details") or {}
    if type(inp) is not int or type(into) is not dict or type(outof) is not dict:
        return None
    return _Usage(inp, _int(out), _int(into.get("cached_tokens")),
                  _int(into.get("cache_write_tokens")), _int(outof.get("reasoning_tokens")))


def _int(value: object) -> int:
    return value if type(value) is int and value > 0 else 0


class PricedMeter(TokenMeter):
    """A token meter (velox.relay.usage.TokenMeter) that also prices: the cost of the answer
    from the usage it reads, the budget's settlement and the ledger row when the request
    ends. One object and one pass over the answer's usage per request (a wrapper around the
    token meter was ~1 us more a request: its own object, a delegating call per meter call,
    the usage read twice). Each Spend makes its own subclass naming it (`spend`, `meters`).

    A plain answer is priced, counted for /metrics and given its ledger row at its body, in
    one native call (Spend.priced: velox.spend.book), so that its `finish` has only a budget's
    reservation left to settle; any other request is priced at its finish, the same way."""

    __slots__ = ("hold", "parts", "cost", "target", "booked")
    spend: Spend

    def __init__(self, ledger: Any, request: Request, strip: bool = False, cap: int = 0,
                 estimated_input: int = -1) -> None:
        TokenMeter.__init__(self, ledger, request, strip, cap, estimated_input)
        held = self.spend.held  # a budgeted key's reservation (Spend.run): settled at finish
        self.hold: _Hold | None = held.pop(request, None) if held else None
        # The usage with its cached, cache-write and reasoning parts when the answer reported
        # any (None: input and output are the whole usage).
        self.parts: UsageLike | None = None
        self.cost: int | None = None  # nano-USD; None: unknown (or not yet priced)
        self.target: _Target | None = None  # what priced it (Spend.target), once priced
        self.booked = False  # priced, counted and its row kept at the body

    def end(self) -> bytes:
        rest: bytes = TokenMeter.end(self)
        sse = self.sse
        if sse is not None and sse.found:  # its parts: priced at finish, with the rest
            self.input, self.output = sse.input, sse.output
            data = sse.usage_data
            found = relay_usage.usage_parts_scan(data[0]) if len(data) == 1 else None
            # OpenAI's one usage chunk read by the native scan (as a plain answer's, `body`);
            # several usage events (Anthropic's start and delta) merged by _parts.
            self.parts = _parts(data) if type(found) is not tuple else \
                _Usage(*found) if found[2] or found[3] or found[4] else None
        return rest

    def told(self, usage: Any) -> None:
        """A translated stream's usage (velox.providers.base.Usage, every part), told at its
        end when the client did not ask for it in the stream (velox.egress.edge, which has
        set input and output)."""
        self.parts = usage if usage.cached_input or usage.cache_write or usage.reasoning \
            else None

    def body(self, body: bytes) -> None:
        # OpenAI's usage object read whole, its parts with it, in one native scan (vx_books):
        # no search of the answer for parts after the token meter's scan (~0.5 us a request);
        # any other form is read as the token meter reads it, its parts by _parts.
        found = relay_usage.usage_parts_scan(body)
        if type(found) is tuple:
            inp, out = found[0], found[1]
            self.input, self.output = inp, out
            self.exact = True
            if self.early:  # TokenMeter.body's rule: nothing to settle, counted now
                self.done = True
                self.ledger.count(self.request, inp, out)
            if found[2] or found[3] or found[4]:
                self.parts = _Usage(*found)
        else:
            TokenMeter.body(self, body)
            if not self.exact:
                return  # no usage in it: priced at finish from what it was charged
            parts = self.parts = _parts((body,))
            found = _usage(self.input, self.output, parts)
        request = self.request
        exchange: Any = request.exchange
        if exchange is not None and 200 <= exchange.status < 300:
            spend = self.spend
            target = self.target = spend.target(exchange)
            # Spend.answer inline (this runs for every plain answer): the cost, its header,
            # /metrics' counter and the ledger row in one native call.
            try:
                self.cost, header = spend.priced.answer(
                    target[4], *found, request.key, target[6], target[5], exchange.status,
                    request.t_received, request.upstream_path, exchange.request_id, True)
            except ValueError:
                self.cost, header = spend.overflow(target, found, True)
            self.booked = True
            if header is not None:
                extra = request.extra_headers
                if extra is None:
                    request.extra_headers = [header]
                else:
                    extra.append(header)

    def _target(self, exchange: Any) -> _Target:
        target = self.target = self.spend.target(exchange)
        return target

    def finish(self, exchange: Any, status: int) -> None:
        if not self.done:  # an early meter counted its tokens at the body (TokenMeter.early)
            TokenMeter.finish(self, exchange, status)
        spend = self.spend
        if not self.booked:  # a stream, or an answer that was no 2xx or had no usage
            target = self._target(exchange)
            if not self.exact:
                # Cut short or no usage reported: what the token meter charged (estimated
                # input and the output relayed), nothing when nothing was used.
                self.parts = None
                if not self.input and not self.output:
                    target = (*target[:4], _FREE, *target[5:])
            self.cost, _ = spend.answer(target, _usage(self.input, self.output, self.parts),
                                        self.request.key, status, self.request, exchange, False)
        hold = self.hold
        if hold is not None:
            self.hold = None
            spend.gate.settle(hold[0], hold[1], self.cost or 0)  # type: ignore[union-attr]


def _usage(inp: int, out: int, parts: UsageLike | None) -> tuple[int, int, int, int, int]:
    """The usage as the native book takes it: the parts' own when the answer reported any."""
    if parts is None:
        return inp, out, 0, 0, 0
    return parts.input, parts.output, parts.cached_input, parts.cache_write, parts.reasoning


class PricedReported(PricedMeter):
    """ReportedMeter's rule (velox.relay.usage: only what the answer reports), priced."""

    __slots__ = ()
    charge_unreported = False

    def __init__(self, ledger: Any, request: Request) -> None:
        PricedMeter.__init__(self, ledger, request, False, 0, 0)
        self._estimate = 1


def _bound(cls: type[PricedMeter], spend: Spend) -> type[PricedMeter]:
    """`cls` naming `spend`: the meter reaches its Spend by a class attribute, not one more
    argument and slot per request (one Spend per worker; the benchmarks make several)."""
    return type(cls.__name__, (cls,), {"__slots__": (), "spend": spend})


def _add_header(request: Request, name: bytes, value: bytes) -> None:
    extra = request.extra_headers
    if extra is None:
        request.extra_headers = [(name, value)]
    else:
        extra.append((name, value))


_NAMES: dict[bytes, str] = {}  # upstream names seen (a few): decoded once


def _name(value: bytes | str) -> str:
    if not isinstance(value, bytes):
        return value
    name = _NAMES.get(value)
    if name is None:
        name = _NAMES[value] = value.decode("latin-1")
    return name


class SpendHost:
    """The supervisor's side: the ledger writer and the budgets' shared memory."""

    def __init__(self, settings: Any, slots: int, with_channel: bool,
                 cluster: Any = None) -> None:
        path = state_file(settings.state_dir) if settings.spend else None
        self.ledger_file = str(path) if path is not None else ""
        self.writer: Any = None
        if path is not None and with_channel:  # rows come over the admin's control channel
            from velox.spend.ledger import LedgerWriter

            self.writer = LedgerWriter(path, settings.ledger_retention_days,
                                       redis_url=settings.redis_url,
                                       stream_maxlen=settings.ledger_stream_maxlen)
            self.writer.open()
        self.slots = slots
        self._budgets: dict[int, SharedBudgets] = {}
        # VELOX_REDIS_URL: the host's refresher (velox.cluster.leases.Cluster), which also
        # leases the budgets' allowances (velox.spend.hosts).
        self.cluster = cluster

    def budgets_for(self, tables: Tables) -> SharedBudgets | None:
        """The budgets' shared state of a configuration: the same one while its budgets
        are the same (a reload keeps what was spent), else made afresh from the ledger."""
        wanted = budgets_of(tables)
        if not wanted:
            return None
        for shared in self._budgets.values():
            if shared.budgets == wanted:
                return shared
        cluster = self.cluster
        shared = SharedBudgets(tables, self.slots, self.ledger_file, leased=cluster is not None)
        self._budgets[id(shared)] = shared
        if cluster is not None:  # the refresher follows the configuration's budgets
            from velox.spend.hosts import BudgetLeases, host_id

            cluster.extras = [BudgetLeases(shared, host_id(self.ledger_file))]
        return shared

    def tick(self, now_s: float | None = None) -> None:
        """The supervisor's wake-up (every 0.2 s): a budget period that ended starts anew."""
        now_s = time.time() if now_s is None else now_s
        for shared in self._budgets.values():
            shared.roll(now_s)
