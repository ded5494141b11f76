"""Spend on the request path: each model call priced, budgets held, one ledger row per request.

Three narrow call sites in the worker, so they can move into a request's single end when the
lifecycle has one:

* `Spend.admit(batch)` after the keys stage: a request of a key under a budget (its own
  `budget_usd`, or a `[[budget]]` team it is in) reserves its estimated cost, or is refused with
  429 `insufficient_quota` when a budget has nothing left.
* `Spend.meter(exchange, inner)` wraps the exchange's token meter (velox.relay.usage) in a
  `PricedMeter`: a non-streamed answer is priced from its body before it is written (so it
  carries `x-velox-cost-usd`); every request is priced again, from its final usage, when it
  ends, settles its reservation to that exact cost and appends its ledger row.
* `Spend.answered(request)` from the worker's on_response: a request answered without an
  exchange (refused, cache hit) gives its reservation back whole.

Budgets in shared memory (`SharedBudgets`, made by the supervisor before the workers fork):
per budget and per worker slot an int64 `used` (the slot's spend in the current period plus
what its requests in flight reserve), the period it belongs to, and the reservations alone.
A slot is written only by its own worker (no lock, no lost update); admission sums `used`
over the slots. A request is admitted while the sum is below the budget and then reserves
its estimate, so the spend goes past a budget by at most what the requests admitted just
before it ran out cost beyond their reservations, plus what two workers admit in the instant
between one's check and the other's add (one request per worker). One extra row holds what
the ledger says was spent in the current period when the budgets were made: a restart
resumes from it.

Periods are calendar periods in UTC (`day`, `week` from Monday, `month`, or `total`); at a
boundary each worker moves its own row into the new period (keeping its reservations) at its
next tick or request, and the ledger's row with it.

What is not priced: a model without a price (cost unknown, logged once per model: it is never
counted as 0, and it reserves nothing, so a budget cannot stop it); embeddings merged by the
batching stage (their members are answered by the batcher without a meter of their own).
Streamed answers are priced from their input and output tokens (the stream's usage chunk
gives no cached or reasoning split here); plain answers price cached and reasoning tokens
apart.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from velox.config.tables import BUDGET_PERIODS, BudgetSpec, PriceSpec, Tables
from velox.core.errors import InsufficientQuota
from velox.core.types import Request, Route
from velox.relay.usage import estimate_scan, usage_of
from velox.spend.ledger import Store, connect, period_start, state_file
from velox.spend.prices import PICO_PER_NANO, PriceTable
from velox.state.stats import Counters

log = logging.getLogger("velox.spend")

# Fields of one budget in a slot's row: USED, the slot's spend in PERIOD plus what its requests
# in flight reserve (the one field admission reads); RESERVED, those reservations alone (read
# only when a slot's worker starts, to drop what a killed predecessor held).
_USED, _PERIOD, _RESERVED = 0, 1, 2
_WIDTH = 3
_MAX_BUDGETS = 4096 // _WIDTH  # a Counters row holds 4,096 fields
NANOS_PER_USD = 10**9
COST_HEADER = b"x-velox-cost-usd"
REMAINING_HEADER = b"x-velox-budget-remaining-usd"
_NO_RETRY = ((b"x-should-retry", b"false"),)
_MODEL_CALL = Route.MODEL_CALL
# A non-zero cached or reasoning count: only then is the body parsed for its details (OpenAI
# sends both members, as 0, in nearly every answer; a parse costs ~2 us, the search ~0.3).
_DETAILS = re.compile(rb'"(?:cached|reasoning)_tokens"\s*:\s*[1-9]')
# API names of the ledger's `api` column, by the request's upstream path.
_APIS = {b"/v1/chat/completions": "chat", b"/v1/completions": "completions",
         b"/v1/embeddings": "embeddings", b"/v1/responses": "responses",
         b"/v1/messages": "messages"}


class _Periods:
    """period_number of the current second, for every period: computed once a second (a
    month's number needs a datetime, ~1.5 us), read from a dict on the hot path."""

    __slots__ = ("second", "numbers")

    def __init__(self) -> None:
        self.second = -1
        self.numbers: dict[str, int] = {}

    def now(self) -> dict[str, int]:
        now_s = time.time()
        second = int(now_s)
        if second != self.second:
            self.numbers = {p: period_number(p, now_s) for p in BUDGET_PERIODS}
            self.second = second
        return self.numbers


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
    """The budgets' counters in shared memory (see the module docstring); made before fork."""

    def __init__(self, tables: Tables, slots: int, ledger_file: str = "",
                 now_s: float | None = None) -> None:
        self.budgets = budgets_of(tables)
        if len(self.budgets) > _MAX_BUDGETS:
            raise ValueError(f"at most {_MAX_BUDGETS} budgets ([[key]] budget_usd and "
                             f"[[budget]] tables together), got {len(self.budgets)}")
        self.slots = slots
        self.base = slots  # the row the supervisor fills from the ledger
        self.counters = Counters(slots + 1, max(1, _WIDTH * len(self.budgets)))
        self.rows = range(slots + 1)
        numbers = _Periods().now()
        for b, budget in enumerate(self.budgets):  # every row starts in the current period
            for row in self.rows:
                self.counters.set(row, _WIDTH * b + _PERIOD, numbers[budget.period])
        if self.budgets and ledger_file:
            self.resume(ledger_file, time.time() if now_s is None else now_s)

    def resume(self, ledger_file: str, now_s: float) -> None:
        """What the ledger holds for each budget's current period becomes the base row."""
        try:
            store = Store(connect(ledger_file, readonly=True))
        except Exception:  # no file yet (first start): nothing was spent
            return
        try:
            now_ms = int(now_s * 1000)
            for b, budget in enumerate(self.budgets):
                since = period_start(budget.period, now_ms)
                spent = store.spent("team" if budget.team else "key", since).get(budget.name)
                base = _WIDTH * b
                self.counters.set(self.base, base + _PERIOD,
                                  period_number(budget.period, now_s))
                self.counters.set(self.base, base + _USED, spent.cost_nanos if spent else 0)
        finally:
            store.conn.close()

    def start_slot(self, slot: int) -> None:
        """A worker starts in `slot`: what a killed predecessor still reserved goes (its
        spend stays)."""
        counters = self.counters
        for b in range(len(self.budgets)):
            base = _WIDTH * b
            counters.add(slot, base + _USED, -counters.get(slot, base + _RESERVED))
            counters.set(slot, base + _RESERVED, 0)

    def roll(self, slot: int, numbers: dict[str, int]) -> None:
        """A new period began for some budget: `slot`'s spend of the old one goes (its
        reservations stay), and the ledger's base row of the old one too. Each worker rolls its
        own slot (on its tick, and at its first request of a new second)."""
        counters = self.counters
        get, put = counters.get, counters.set
        for b, budget in enumerate(self.budgets):
            number = numbers[budget.period]
            base = _WIDTH * b
            if get(slot, base + _PERIOD) != number:
                put(slot, base + _USED, get(slot, base + _RESERVED))
                put(slot, base + _PERIOD, number)
            if get(self.base, base + _PERIOD) != number:
                put(self.base, base + _USED, 0)
                put(self.base, base + _PERIOD, number)

    def used(self, b: int) -> int:
        """Spent in the current period plus reserved, over every slot and the ledger's base
        (a slot not yet rolled into a new period counts its old spend for at most a tick)."""
        get = self.counters.get
        field = _WIDTH * b
        total = 0
        for row in self.rows:
            total += get(row, field)
        return total

    def reserved(self, b: int) -> int:
        """What the requests in flight reserve from budget `b`, every slot (a refusal's
        message: not on the admission path)."""
        get = self.counters.get
        field = _WIDTH * b + _RESERVED
        return sum(get(row, field) for row in self.rows)

    def reserve(self, slot: int, b: int, amount: int) -> None:
        base = _WIDTH * b
        self.counters.add_many(slot, base + _USED, amount, base + _RESERVED, amount)

    def charge(self, slot: int, b: int, reserved: int, cost: int) -> None:
        """Settle one request of `slot`: its reservation becomes its cost."""
        base = _WIDTH * b
        self.counters.add_many(slot, base + _USED, cost - reserved, base + _RESERVED, -reserved)

    def snapshot(self) -> list[dict[str, Any]]:
        return [{"name": b.name, "team": b.team, "period": b.period,
                 "budget_usd": b.nanos / NANOS_PER_USD, "used_usd": self.used(i) / NANOS_PER_USD}
                for i, b in enumerate(self.budgets)]


class _Hold:
    """What an admitted request of a budgeted key holds until it ends."""

    __slots__ = ("budgets", "reserved")

    def __init__(self, budgets: tuple[int, ...], reserved: int) -> None:
        self.budgets = budgets
        self.reserved = reserved


class Spend:
    """Per worker: pricing, the budgets' admission and settlement, the ledger rows."""

    def __init__(self, tables: Tables, shared: SharedBudgets | None, slot: int,
                 default_output: int) -> None:
        self.prices = PriceTable(tables.prices)
        self.shared = shared
        self.slot = slot
        self.default_output = default_output
        self.feed: Any = None  # velox.admin.ledgerfeed.LedgerFeed, set by the agent
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
        self.held: dict[Request, _Hold] = {}
        self.periods = _Periods()
        self.rolled: dict[str, int] | None = None  # the period numbers last rolled to
        # Where a route sends first: (upstream, upstream model) to price an estimate with.
        self._first = {r.model: (r.targets[0].upstream, r.targets[0].model)
                       for r in tables.routes}
        self._catch_all = self._first.get("*")

    def roll(self, numbers: dict[str, int] | None = None) -> None:
        """Move this slot's budgets into the current periods (see SharedBudgets.roll)."""
        numbers = self.periods.now() if numbers is None else numbers
        self.rolled = numbers
        if self.shared is not None:
            self.shared.roll(self.slot, numbers)

    # --- admission ------------------------------------------------------------------------

    def admit(self, requests: list[Request]) -> list[Request]:
        """Reserve the estimated cost of each budgeted request; refuse those whose budget is
        spent (429 insufficient_quota). Requests of no budget pass untouched."""
        key_budgets = self.key_budgets
        out: list[Request] = []
        for request in requests:
            k = request.key
            if k < 0 or not key_budgets[k]:
                out.append(request)
                continue
            if self._admit_one(request, key_budgets[k]):
                out.append(request)
        return out

    def _admit_one(self, request: Request, budgets: tuple[int, ...]) -> bool:
        shared = self.shared
        assert shared is not None
        numbers = self.periods.now()
        if numbers is not self.rolled:  # a new second: did a period end?
            self.roll(numbers)
        lowest = None
        for b in budgets:
            budget = self.budgets[b]
            left = budget.nanos - shared.used(b)
            if left <= 0:
                self._refuse(request, budget, shared.reserved(b))
                return False
            lowest = left if lowest is None or left < lowest else lowest
        estimate = self.estimate(request)
        for b in budgets:
            shared.reserve(self.slot, b, estimate)
        self.held[request] = _Hold(budgets, estimate)
        # What the tightest budget had left when this request was admitted (before its cost).
        _add_header(request, REMAINING_HEADER, usd_text(lowest or 0))
        return True

    def estimate(self, request: Request) -> int:
        """Nano-USD a model call may cost: its estimated input and output (velox.relay.usage's
        rule: body bytes / 4, max_*tokens or VELOX_TOKENS_DEFAULT_OUTPUT) at its first
        target's price; 0 when it has no price or is no model call."""
        if request.route is not _MODEL_CALL:
            return 0
        model = request.model or ""
        first = self._first.get(model, self._catch_all)
        if first is None:
            return 0
        upstream, target_model = first
        price = self.prices.price_for(upstream, target_model or model)  # memoised
        if price is None:
            return 0
        inp, out = estimate_scan(request.body)
        return plain_cost(price, inp, out if out >= 0 else self.default_output)

    def _refuse(self, request: Request, budget: Budget, reserved: int) -> None:
        """429 insufficient_quota. Spent: final for the period (x-should-retry: false keeps
        the SDKs from retrying). Not spent, but what is left is reserved by requests in
        flight (each reserves its estimate, which without max_tokens assumes
        VELOX_TOKENS_DEFAULT_OUTPUT): the same error, saying so, with Retry-After 1."""
        ticket = request.ticket
        if ticket is not None:  # the key stage's reservations: nothing was used
            ticket.settle(0)
            ticket.release()
        what = f"team budget {budget.name!r}" if budget.team else \
            f"budget of gateway key {budget.name!r}"
        period = "in total" if budget.period == "total" else f"this {budget.period} (UTC)"
        limit = f"{usd_text(budget.nanos).decode()} USD {period}"
        spent = self.shared.used(self.budgets.index(budget)) - reserved \
            if self.shared is not None else budget.nanos
        if spent >= budget.nanos or reserved <= 0:
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
        shared = self.shared
        assert shared is not None
        numbers = self.periods.now()
        if numbers is not self.rolled:
            self.roll(numbers)
        for b in hold.budgets:
            shared.charge(self.slot, b, hold.reserved, cost)

    def meter(self, exchange: Any, inner: Any) -> PricedMeter:
        return PricedMeter(self, exchange.request, inner, self.held.pop(exchange.request, None))

    def price(self, exchange: Any, usage: _Usage) -> int | None:
        attempt = exchange.route_attempt
        request = exchange.request
        model = attempt.model if attempt is not None and attempt.model else request.model or ""
        upstream = _name(exchange.upstream_name)
        if usage.cached_input or usage.cache_write or usage.reasoning:
            return self.prices.cost(upstream, model, usage)
        price = self.prices.price_for(upstream, model)  # memoised
        if price is None:
            return self.prices.cost(upstream, model, usage)  # None, logged once per model
        return plain_cost(price, usage.input, usage.output)

    def row(self, exchange: Any, status: int, usage: _Usage, cost: int | None) -> None:
        feed = self.feed
        if feed is None:
            return
        request = exchange.request
        attempt = exchange.route_attempt
        k = request.key
        feed.add((time.time_ns() // 1_000_000,
                  self.key_names[k] if k >= 0 else "", self.team_of[k] if k >= 0 else "",
                  attempt.route.model if attempt is not None else request.model or "",
                  _name(exchange.upstream_name),
                  attempt.model if attempt is not None and attempt.model else
                  request.model or "",
                  _api(request.upstream_path),
                  status, usage.input, usage.output, usage.cached_input, usage.cache_write,
                  usage.reasoning, cost,
                  (time.perf_counter_ns() - request.t_received) // 1000,
                  _request_id(exchange.headers)))


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


def usage_details(body: bytes) -> _Usage | None:
    """A plain answer's usage with its cached and reasoning parts (OpenAI's
    prompt_tokens_details.cached_tokens and completion_tokens_details.reasoning_tokens);
    None when it reports none. The details are read only when the body names them."""
    numbers = usage_of(body)
    if numbers is None:
        return None
    return _details(body, _Usage(*numbers))


def _details(body: bytes, usage: _Usage) -> _Usage:
    """`usage` with the cached and reasoning counts of the body's usage, when not 0."""
    if _DETAILS.search(body) is not None:
        try:
            found = orjson.loads(body).get("usage") or {}
        except (orjson.JSONDecodeError, AttributeError):
            return usage
        prompt = found.get("prompt_tokens_details") or {}
        completion = found.get("completion_tokens_details") or {}
        usage.cached_input = _int(prompt.get("cached_tokens"))
        usage.reasoning = _int(completion.get("reasoning_tokens"))
    return usage


def _int(value: object) -> int:
    return value if type(value) is int and value > 0 else 0


class PricedMeter:
    """The exchange's meter (velox.relay.usage.Meter) with a price: delegates the token
    accounting to `inner` and adds the cost, the budget settlement and the ledger row."""

    __slots__ = ("spend", "request", "inner", "hold", "usage", "cost", "input", "output",
                 "exact", "done")

    def __init__(self, spend: Spend, request: Request, inner: Any, hold: _Hold | None) -> None:
        self.spend = spend
        self.request = request
        self.inner = inner
        self.hold = hold
        self.usage: _Usage | None = None  # exact usage, once the answer gave it
        self.cost: int | None = None  # nano-USD; None: unknown (or not yet priced)
        self.input = self.output = 0  # the access log reads these (as from any meter)
        self.exact = self.done = False

    @property
    def estimate(self) -> int:
        return self.inner.estimate  # type: ignore[no-any-return]

    def for_attempt(self, body: Any, stream_usage: bool) -> Any:
        return self.inner.for_attempt(body, stream_usage)

    def response(self, status: int, sse: bool) -> None:
        self.inner.response(status, sse)

    def data(self, data: bytes) -> bytes:
        return self.inner.data(data)  # type: ignore[no-any-return]

    def stream_feed(self) -> Callable[[bytes], bytes] | None:
        return self.inner.stream_feed()  # type: ignore[no-any-return]  # data: the inner's

    def end(self) -> bytes:
        rest: bytes = self.inner.end()
        sse = getattr(_token_meter(self.inner), "sse", None)
        if sse is not None and sse.found:  # priced before the access log's line is made
            self._priced(_Usage(sse.input, sse.output))
        return rest

    def body(self, body: bytes) -> None:
        inner = self.inner
        inner.body(body)
        # The token meter has read the usage (a CountMeter, natively): only the details are
        # left to find, and only when the body has any.
        usage = _details(body, _Usage(inner.input, inner.output)) if inner.exact else \
            usage_details(body)
        exchange: Any = self.request.exchange
        if usage is not None and exchange is not None and 200 <= exchange.status < 300:
            cost = self._priced(usage, exchange)
            if cost is not None:
                _add_header(self.request, COST_HEADER, usd_text(cost))

    def _priced(self, usage: _Usage, exchange: Any = None) -> int | None:
        exchange = exchange if exchange is not None else self.request.exchange
        if exchange is None:
            return None
        self.usage = usage
        self.cost = self.spend.price(exchange, usage)
        return self.cost

    def finish(self, exchange: Any, status: int) -> None:
        inner = self.inner
        inner.finish(exchange, status)
        self.input, self.output, self.exact = inner.input, inner.output, inner.exact
        usage = self.usage
        if usage is None or not self.exact:
            # Cut short or no usage reported: what the token meter charged (estimated input
            # and the output relayed), nothing when nothing was used.
            usage = self.usage = _Usage(inner.input, inner.output)
            used = inner.input or inner.output
            self.cost = self.spend.price(exchange, usage) if used else 0
        spend = self.spend
        hold = self.hold
        if hold is not None:
            self.hold = None
            spend._settle(hold, self.cost or 0)
        spend.row(exchange, status, usage, self.cost)
        self.done = True


def _token_meter(meter: Any) -> Any:
    """The TokenMeter doing the work (a CountMeter hands over to one, velox.relay.usage)."""
    full = getattr(meter, "full", None)
    return full if full is not None and hasattr(full, "sse") else meter


def _add_header(request: Request, name: bytes, value: bytes) -> None:
    extra = request.extra_headers
    if extra is None:
        request.extra_headers = [(name, value)]
    else:
        extra.append((name, value))


def usd_text(nanos: int) -> bytes:
    """Nano-USD as a decimal of USD with 9 places at most, trailing zeros cut."""
    whole, frac = divmod(nanos, NANOS_PER_USD)
    if not frac:
        return b"%d" % whole
    return (b"%d.%09d" % (whole, frac)).rstrip(b"0")


def cost_field(exchange: Any) -> bytes:
    """The access log's `cost_usd` of a request: a number, or null (unknown or not priced)."""
    meter = getattr(exchange, "meter", None) if exchange is not None else None
    if type(meter) is not PricedMeter or meter.cost is None:
        return b"null"
    return usd_text(meter.cost)


def _api(path: bytes) -> str:
    api = _APIS.get(path)
    return api if api is not None else _APIS.get(path.split(b"?", 1)[0], "other")


_NAMES: dict[bytes, str] = {}  # upstream names seen (a few): decoded once


def _name(value: bytes | str) -> str:
    if not isinstance(value, bytes):
        return value
    name = _NAMES.get(value)
    if name is None:
        name = _NAMES[value] = value.decode("latin-1")
    return name


def _request_id(headers: Sequence[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == b"x-request-id":
            return value.decode("latin-1")[:128]
    return ""


class SpendHost:
    """The supervisor's side: the ledger writer and the budgets' shared memory."""

    def __init__(self, settings: Any, slots: int, with_channel: bool) -> None:
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

    def budgets_for(self, tables: Tables) -> SharedBudgets | None:
        """The budgets' shared state of a configuration: the same one while its budgets
        are the same (a reload keeps what was spent), else made afresh from the ledger."""
        wanted = budgets_of(tables)
        if not wanted:
            return None
        for shared in self._budgets.values():
            if shared.budgets == wanted:
                return shared
        shared = SharedBudgets(tables, self.slots, self.ledger_file)
        self._budgets[id(shared)] = shared
        return shared
