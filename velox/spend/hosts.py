"""Budgets across hosts (VELOX_REDIS_URL): every host's spend counts against one budget.

Each host's budgets are native buckets (velox.spend.wire.SharedBudgets) that admission takes
from and settlement charges or refunds. Alone, a host fills them with the whole budget; with
Redis they hold only an ALLOWANCE leased from Redis by the host's refresher
(velox.cluster.leases, one thread in the supervisor), on the same connection and tick as the
rate limits' leases.

Redis keeps, per budget and period, one hash `velox:budget:<key|team>:<name>:<period>:<first
day>` (expiring a day after its period could end, a `total` budget never) with three fields
per host:

* `u:<host>`: what the host USED in the period: its settled spend plus the estimates its
  requests in flight reserve (a settlement's refund lowers it), in units of the budget
  (1 micro-USD up to $1,000). The host knows it locally: the spend its own ledger holds for
  the period when it started, plus what its bucket was given since, less what the bucket
  holds. The host sends the absolute value, not an increment: the same report after a lost
  reply, or twice, changes nothing.
* `a:<host>`: the allowance the host holds unused (its bucket's level).
* `t:<host>`: Redis time of its last report; the allowance of a host not heard from for
  `HOST_TTL_S` (5 s) is not counted any more (a host killed without returning it).

One script call per tick carries every budget (`BUDGET_LUA`, atomic, Redis's clock): the
host's report and, for a budget whose allowance runs low, its ask. A grant is made only while
the sum of every host's used and held stays within the budget: grant = min(ask, budget - sum).
The ask is about a second of the host's recent demand (takes admitted or refused, in units),
at least the largest estimate a request took lately (so the next request fits without debt),
capped at `CAP_SHARE` of the budget / hosts alive (`allowance_cap`). The host calls when it
asks or when its figures changed (each tick under load: 20 small calls a second per host),
and at least every second otherwise. The call follows the rate leases' on the same
connection: a second round trip in those ticks, not pipelined with them.

Redis lost its data (restarted without persistence): every host's next report is absolute,
so the sum is rebuilt from the hosts' own figures. Until every host has reported, the sum is
short; so a hash found missing by a host that had reported to it before (or while the rate
leases' `lost` flag is up) is held for `HOLD_S`: no grant from it until then (each host keeps
what it holds meanwhile).

Redis unreachable: each host keeps what it holds, and gets once, from its own budget, its
share of what Redis last said no host held nor used: left / hosts last seen. A host that never
reached Redis counts as alone (as the rate limits do). When Redis is back the reports make the
sum whole again, whatever the hosts spent meanwhile.

Admission (velox.spend.wire.SharedBudgets.may_borrow): a request is admitted while its host
holds anything, its estimate taken into debt when less is held, as on one host; and, when
its host holds nothing, while the host's debt is under one request's estimate and Redis last
said at least that much was left unallocated (so a host's first request, or one after an idle
spell, does not wait for a grant: the next grant pays the debt).

The bound. Every grant keeps sum(used + held) within the budget, and the debts are reported
as use. Spend goes past the budget by at most
    (the requests in flight when it ran out: each admitted while its host held anything, its
     estimate taken into debt, then settled to its exact cost, as on one host)
  + hosts x allowance (after a data loss, what hosts not yet heard from held; an allowance is
     at most the cap or one request's estimate)
  + hosts x allowance (a debt borrowed against a view of what was left a tick old)
  + during an outage, 2 x hosts x allowance: the shares add up to what was left as each host
     last saw it, and a host's view is behind by at most a call or two of each other host
     (each granted at most one allowance), as every host reports each tick under load.
A run under demand above the budget stops short of it by at most what the hosts hold unused
when it ends: hosts x allowance. `bound()` computes the stated terms. Periods roll on the
refresher's tick: a host that cannot reach Redis when a period ends keeps the old one until
Redis is back.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from velox.cluster.leases import (
    HEARTBEAT_S,
    HOST_TTL_S,
    KEY_PREFIX,
    LEASE_S,
    LOST_KEY,
    NEED_HALF_LIFE_S,
    RATE_HALF_LIFE_S,
    TICK_S,
    ReplyShapeError,
    script_sha,
)
from velox.spend.gate import NANOS_PER_USD
from velox.spend.ledger import EARLIER, period_start

if TYPE_CHECKING:
    from velox.cluster.leases import Cluster

log = logging.getLogger("velox.spend")

CAP_SHARE = 0.05  # an allowance is at most 5% of the budget / hosts (or one request's estimate)
HOLD_S = 2.5  # after a data loss: a heartbeat (1 s) of every host, plus a reconnect (0.5 s)
CHUNK = 500  # budgets per script call (bounds its run time inside Redis)
# Each budget hash lives this long after its last report beyond its period's length, so it
# outlives its period (a key per period: the old ones go by themselves).
_DAY_MS = 86_400_000
_EXPIRE_MS = {"day": 2 * _DAY_MS, "week": 8 * _DAY_MS, "month": 32 * _DAY_MS, "total": 0}

# KEYS[1]: the rate leases' `lost` flag; KEYS[2..]: one hash per budget and period.
# ARGV[1]: host id, ARGV[2]: host TTL (ms), ARGV[3]: hold (ms); then per budget: budget,
# used, held, ask (units), "1" when this host reported to this hash before, expiry (ms, 0:
# none). Returns per budget: granted, left (budget - sum of used and held, after the grant),
# 1 while grants are held after a data loss.
BUDGET_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local host = ARGV[1]
local ttl = tonumber(ARGV[2])
local lost = redis.call('EXISTS', KEYS[1])
local out = {}
for i = 2, #KEYS do
  local a = 4 + (i - 2) * 6
  local size = tonumber(ARGV[a])
  local want = tonumber(ARGV[a + 3])
  local expire = tonumber(ARGV[a + 5])
  local k = KEYS[i]
  if redis.call('EXISTS', k) == 0 and (ARGV[a + 4] == '1' or lost == 1) then
    redis.call('HSET', k, 'hold', now + tonumber(ARGV[3]))
  end
  redis.call('HSET', k, 'u:' .. host, ARGV[a + 1], 'a:' .. host, ARGV[a + 2], 't:' .. host, now)
  local f = redis.call('HGETALL', k)
  local seen = {}
  for j = 1, #f, 2 do
    if string.sub(f[j], 1, 2) == 't:' then seen[string.sub(f[j], 3)] = tonumber(f[j + 1]) end
  end
  local total = 0
  local hold = 0
  for j = 1, #f, 2 do
    local p = string.sub(f[j], 1, 2)
    if p == 'u:' then
      total = total + tonumber(f[j + 1])
    elseif p == 'a:' then
      local s = seen[string.sub(f[j], 3)]
      if s ~= nil and now - s <= ttl then total = total + tonumber(f[j + 1]) end
    elseif f[j] == 'hold' then
      hold = tonumber(f[j + 1])
    end
  end
  local grant = 0
  if want > 0 and now >= hold then
    grant = math.min(want, size - total)
    if grant > 0 then
      redis.call('HINCRBY', k, 'a:' .. host, grant)
      total = total + grant
    else
      grant = 0
    end
  end
  if expire > 0 then redis.call('PEXPIRE', k, expire) end
  out[#out + 1] = grant
  out[#out + 1] = size - total
  out[#out + 1] = now < hold and 1 or 0
end
return out
"""


def allowance_cap(size: int, hosts: int) -> int:
    """The most a host asks for on its own demand (units): CAP_SHARE of the budget over the
    hosts alive, at least 1. A host may hold one request's estimate when that is more."""
    return max(1, math.ceil(size * CAP_SHARE / max(1, hosts)))


def allowance_ask(rate_est: float, need: float, cap: int, size: int, level: int) -> int:
    """Units to ask for now: the target is a second of the demand (at least 1, at most `cap`)
    or the largest recent estimate `need` if more, within the budget; asked when the level is
    down to half of it."""
    target = min(size, max(min(cap, max(1, math.ceil(rate_est * LEASE_S))), math.ceil(need)))
    if level * 2 <= target and level < target:
        return target - level
    return 0


def bound(size: int, hosts: int, largest: int, in_flight: int, estimate: int = 1,
          outage: bool = False) -> int:
    """The stated excess over a budget (units): `in_flight` requests' exact costs past what
    was left (at most `largest` each), plus an allowance per host (what hosts not yet heard
    from held after a data loss: at most the cap or one request's `estimate`) and one more
    (a debt borrowed against a stale view of what was left), plus with an `outage` two more
    per host (the hosts' views of what was left, behind by at most the
    grants of one call of each other host: see the module docstring)."""
    allowance = max(allowance_cap(size, 1), estimate)
    return in_flight * largest + hosts * allowance * (4 if outage else 2)


def host_id(ledger_file: str) -> str:
    """The host's name in the budgets' hashes: kept beside its ledger, so a restarted host
    (which resumes from that ledger) reports under the same name instead of counting its
    spend twice; a host without a ledger gets a new one each start (and starts from 0)."""
    if not ledger_file:
        return secrets.token_hex(8)
    path = Path(ledger_file).with_name("budget-host-id")
    try:
        return path.read_text().strip() or _new_id(path)
    except FileNotFoundError:
        return _new_id(path)


def _new_id(path: Path) -> str:
    name = secrets.token_hex(8)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(name + "\n")
    os.replace(tmp, path)
    return name


class BudgetsLike(Protocol):
    """What the refresher needs of velox.spend.wire.SharedBudgets."""

    budgets: tuple[Any, ...]  # Budget: name, team, period
    sizes: tuple[int, ...]  # each budget in its units
    base: list[int]  # units spent in the current period before this start (the ledger)
    limits: Any  # the native buckets
    units: tuple[int, ...]  # nano-USD per unit, each budget
    across: Any  # Counters(1, n): left unallocated across hosts, per budget


@dataclass(slots=True)
class _State:
    """The refresher's view of one budget: its period, what its bucket was given, demand."""

    key: str = ""  # the Redis hash of the current period
    period: str = ""  # its first day (velox.spend.ledger.period_start)
    base: int = 0  # used in the period before the current gives (units)
    given: int = 0  # units given to the bucket (allowances, outage shares) since start
    known: bool = False  # this host has reported to `key`
    rate_est: float = 0.0  # units asked per second (taken or refused), recently
    need: float = 0.0  # the largest take lately (a request's estimate), decaying
    last_taken: int = 0
    last_refused: int = 0
    next_ask: float = 0.0  # monotonic time before which no ask (the budget was short)
    # /metrics (velox.admin.metrics): asks sent, answered with some or none, units granted.
    asked: int = 0
    granted: int = 0
    refused: int = 0
    granted_units: int = 0


class BudgetLeases:
    """The refresher's side of the budgets (`Cluster.extras`): one per host."""

    def __init__(self, shared: BudgetsLike, host: str) -> None:
        self.host = host
        self.shared = shared
        self.states = [_State(base=shared.base[b], last_taken=shared.limits.taken(b),
                              last_refused=shared.limits.refused(b))
                       for b in range(len(shared.budgets))]
        self.sha = ""
        self.granted = 0  # units granted by Redis (for tests and /metrics)
        self.held_back = 0  # calls answered "held after a data loss"
        self._last_call = 0.0
        self._last_tick = 0.0
        self._reported: list[tuple[int, int]] = []  # (used, level) per budget, last sent
        self._holding = False  # Redis answered "held after a data loss" (logged once)

    def used(self, b: int) -> int:
        """Units this host used in budget b's period: spent plus reserved by requests in
        flight (its bucket got `given`, holds its level)."""
        st = self.states[b]
        level: int = self.shared.limits.level(b)
        return st.base + st.given - level

    # --- the tick ---------------------------------------------------------------------------

    async def tick(self, client: Any, cluster: Cluster, now: float) -> None:
        rolled = self._roll(time.time())
        asks = self._plan(now, cluster.hosts)
        limits = self.shared.limits
        report = [(self.used(b), limits.level(b)) for b in range(len(self.states))]
        if not rolled and not any(asks) and report == self._reported and \
                now - self._last_call < HEARTBEAT_S:
            return
        self._reported = report
        self._last_call = now
        replies = await self._call(client, cluster, asks, report)
        shared = self.shared
        holding = False
        for b, (want, (granted, left, held)) in enumerate(zip(asks, replies, strict=True)):
            st = self.states[b]
            st.known = True
            if want:
                st.asked += 1
                if granted:
                    st.granted += 1
                else:
                    st.refused += 1
            if granted:
                st.given += limits.give(b, granted)
                self.granted += granted
                st.granted_units += granted
            if want and granted < want:  # short (or held): ask again in a while, not each tick
                st.next_ask = now + (TICK_S if held else LEASE_S)
            self.held_back += held
            holding = holding or bool(held)
            shared.across.set(0, b, max(0, left))
        if holding and not self._holding:
            log.warning("Redis lost the budgets' data: rebuilding each period's spend from "
                        "every host's report; no allowance is granted for %gs meanwhile",
                        HOLD_S)
        self._holding = holding

    def _roll(self, now_s: float) -> bool:
        """A budget whose period changed: a new hash, its used back to 0 (what the bucket
        holds is the old period's allowance: taken back)."""
        rolled = False
        days: dict[str, str] = {}
        for b, budget in enumerate(self.shared.budgets):
            first = days.get(budget.period)
            if first is None:
                first = days[budget.period] = period_start(budget.period, int(now_s * 1000))
            st = self.states[b]
            if first == st.period:
                continue
            if st.period:  # not the first tick: a new period began
                self._take_back(b)
                st.base = -(st.given - self.shared.limits.level(b))
            st.period, st.known, st.next_ask = first, False, 0.0
            kind = "team" if budget.team else "key"
            day = "all" if first == EARLIER else first
            st.key = f"{KEY_PREFIX}budget:{kind}:{budget.name}:{budget.period}:{day}"
            rolled = True
        return rolled

    def _take_back(self, b: int) -> None:
        """The bucket's unused allowance leaves it (not spent: `given` goes down with it)."""
        limits = self.shared.limits
        level = limits.level(b)
        if level > 0 and limits.take(b, level) == 0:
            limits.pop_largest(b)  # no request's take: no demand
            st = self.states[b]
            st.given -= level
            st.last_taken = limits.taken(b)

    def _plan(self, now: float, hosts: int) -> list[int]:
        """Update each budget's demand estimate; what to ask for now (0: nothing)."""
        dt = now - self._last_tick if self._last_tick else TICK_S
        self._last_tick = now
        decay = 0.5 ** (dt / RATE_HALF_LIFE_S)
        need_decay = 0.5 ** (dt / NEED_HALF_LIFE_S)
        limits, sizes = self.shared.limits, self.shared.sizes
        asks = []
        for b, st in enumerate(self.states):
            taken, refused = limits.taken(b), limits.refused(b)
            # Refunds lower `taken`: only growth is demand; refused takes are demand too (a
            # host with nothing left must still ask).
            asked = max(0, taken - st.last_taken) + (refused - st.last_refused)
            st.last_taken, st.last_refused = taken, refused
            st.rate_est = max(asked / dt if dt > 0 else 0.0, st.rate_est * decay)
            st.need = max(float(limits.pop_largest(b)), st.need * need_decay)
            if now < st.next_ask:
                asks.append(0)
                continue
            asks.append(allowance_ask(st.rate_est, st.need, allowance_cap(sizes[b], hosts),
                                      sizes[b], limits.level(b)))
        return asks

    async def _call(self, client: Any, cluster: Cluster, asks: list[int],
                    report: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """Every budget's report ((used, level) each) and ask in one script call per CHUNK
        budgets, pipelined."""
        from redis.exceptions import NoScriptError

        states, sizes = self.states, self.shared.sizes
        budgets = self.shared.budgets
        head = [self.host, int(HOST_TTL_S * 1000), int(HOLD_S * 1000)]
        chunks = [range(i, min(i + CHUNK, len(states))) for i in range(0, len(states), CHUNK)]
        for attempt in (0, 1):
            if not self.sha:
                self.sha = script_sha(await client.script_load(BUDGET_LUA))
                cluster.commands += 1
            pipe = client.pipeline(transaction=False)
            for chunk in chunks:
                keys = [LOST_KEY, *(states[b].key for b in chunk)]
                args: list[Any] = list(head)
                for b in chunk:
                    used, level = report[b]
                    args += [sizes[b], used, max(0, level), asks[b],
                             1 if states[b].known else 0, _EXPIRE_MS[budgets[b].period]]
                pipe.evalsha(self.sha, len(keys), *keys, *args)
            cluster.commands += len(chunks)
            try:
                results = await pipe.execute()
                break
            except NoScriptError:  # Redis restarted and lost its script cache
                if attempt:
                    raise
                self.sha = ""
        return replies(results, [len(c) for c in chunks])

    def metrics(self) -> list[dict[str, Any]]:
        """Per budget, for /metrics: its name and kind, the asks for an allowance sent to
        Redis and how many were granted something or nothing, the USD granted, and the
        allowance this host holds unused now (its bucket's level)."""
        shared, out = self.shared, []
        for b, st in enumerate(self.states):
            budget = shared.budgets[b]
            unit = shared.units[b]
            out.append({"budget": budget.name, "kind": "team" if budget.team else "key",
                        "asked": st.asked, "granted": st.granted, "refused": st.refused,
                        "granted_usd": st.granted_units * unit / NANOS_PER_USD,
                        "held_usd": max(0, shared.limits.level(b)) * unit / NANOS_PER_USD})
        return out

    # --- Redis went away, the host stops ------------------------------------------------------

    def down(self, hosts: int) -> None:
        """Redis is unreachable: each bucket gets once the host's share of what was left
        unallocated at the last call (left / hosts last seen)."""
        shared = self.shared
        for b, st in enumerate(self.states):
            share = max(0, shared.across.get(0, b)) // max(1, hosts)
            if share:
                st.given += shared.limits.give(b, share)
            shared.across.set(0, b, 0)

    async def leave(self, client: Any, cluster: Cluster) -> None:
        """The workers are gone: the unused allowances go back (held 0, used unchanged)."""
        n = len(self.states)
        for b in range(n):
            self._take_back(b)
        await self._call(client, cluster, [0] * n,
                         [(self.used(b), self.shared.limits.level(b)) for b in range(n)])


def replies(results: Any, sizes: list[int]) -> list[tuple[int, int, int]]:
    """[(granted, left, held)] per budget from the script calls' replies, once each has
    BUDGET_LUA's shape for its chunk; else ReplyShapeError."""
    if not isinstance(results, list) or len(results) != len(sizes):
        raise ReplyShapeError("budget script replies do not match the calls")
    out = []
    for result, n in zip(results, sizes, strict=True):
        if not isinstance(result, list) or len(result) != 3 * n or \
                not all(type(v) is int for v in result):
            raise ReplyShapeError(f"a budget script call answered something else than "
                                  f"{3 * n} integers")
        out += [(result[3 * k], result[3 * k + 1], result[3 * k + 2]) for k in range(n)]
    return out

