"""velox._native.Health / RetryBudget / hash64 / Rendezvous, and velox.state.health.SharedHealth.

The breaker's state machine through the binding with an explicit clock; forked processes
hammering one shared state (exactly one opener per opening, the in-flight cap and the retry
budget exact across processes, evidence from one process protecting the others); the
SharedHealth built from tables driving velox.routing.balance end to end (failures through retry()
open a breaker for every worker, panic, rpm refusals); bad arguments named in ValueErrors.
"""

from __future__ import annotations

import multiprocessing
import os
import random
from collections.abc import Callable
from typing import Any

import pytest

from velox import _native
from velox._native import Health, Rendezvous, RetryBudget, hash64
from velox.config.tables import (
    BreakerPolicy,
    RetryPolicy,
    RouteSpec,
    TableError,
    Tables,
    TargetSpec,
    UpstreamSpec,
)
from velox.core.clock import now_ms
from velox.core.errors import RateLimited
from velox.routing.balance import Event, Router, verdict_of
from velox.state.health import (
    FAILURE,
    NEUTRAL,
    REASON_FULL,
    REASON_OPEN,
    REASON_RATE,
    SUCCESS,
    SharedHealth,
)

T0 = 10**9  # an explicit clock well clear of the real one


def health(n: int = 1, caps: list[int] | None = None, **policy: int) -> Health:
    p = {"failures": 5, "successes": 2, "open_ms": 30_000, "max_open_ms": 300_000,
         "probes": 1, "probe_lease_ms": 60_000}
    p.update(policy)
    return Health(caps or [0] * n, **p)


def run_children(body: Callable[..., Any], args_list: list[tuple[Any, ...]]) -> list[Any]:
    """Fork one child per args tuple, each running body(*args) and sending its result back."""
    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in args_list]

    def main(send: Any, args: tuple[Any, ...]) -> None:
        send.send(body(*args))

    procs = [ctx.Process(target=main, args=(send, args))
             for (_, send), args in zip(pipes, args_list, strict=True)]
    try:
        for p in procs:
            p.start()
        results = []
        for recv, _ in pipes:
            assert recv.poll(60), "a child did not report"
            results.append(recv.recv())
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


# ------------------------------------------------------------------------------ breaker


def test_breaker_cycle_with_explicit_clock() -> None:
    h = health(2)
    for _ in range(4):
        assert h.report(0, 0, FAILURE, T0) == _native.TR_NONE
    assert h.peek(0, T0) == _native.PEEK_CLOSED and h.check(0, T0) == 0
    assert h.report(0, 0, FAILURE, T0) == _native.TR_OPENED
    state, _count, _probes, streak, _stamp, opened_at, opens, until = h.breaker(0, T0 + 10_000)
    assert (state, streak, opened_at, opens, until) == (_native.BREAKER_OPEN, 1, T0, 1, 20_000)
    assert h.enter(0, T0 + 29_999) == -1 and h.check(0, T0 + 29_999) == REASON_OPEN
    assert h.check(1, T0) == 0  # the other upstream is untouched
    ticket = h.enter(0, T0 + 30_000)
    assert ticket > 0 and h.peek(0, T0 + 30_000) == _native.PEEK_PROBING
    assert h.report(0, ticket, FAILURE, T0 + 30_001) == _native.TR_REOPENED
    assert h.breaker(0, T0 + 30_001)[7] == 60_000  # doubled
    ticket = h.enter(0, T0 + 90_001)
    assert h.report(0, ticket, SUCCESS, T0 + 90_002) == _native.TR_NONE
    ticket = h.enter(0, T0 + 90_003)
    assert h.report(0, ticket, SUCCESS, T0 + 90_004) == _native.TR_CLOSED
    assert h.breaker(0, T0 + 90_004)[:4] == (_native.BREAKER_CLOSED, 0, 0, 0)


def _fail_many(h: Health, n: int, now: int) -> int:
    return sum(h.report(0, 0, FAILURE, now) == _native.TR_OPENED for _ in range(n))


def test_exactly_one_opener_across_processes() -> None:
    for _ in range(3):
        h = health(failures=5)
        opened = run_children(_fail_many, [(h, 2000, T0)] * 4)
        assert sum(opened) == 1
        assert h.breaker(0, T0)[6] == 1  # open_count


def _probe_many(h: Health, n: int, now: int) -> int:
    return sum(h.enter(0, now) > 0 for _ in range(n))


def test_probe_slots_are_exact_across_processes() -> None:
    h = health(probes=3, open_ms=1000, max_open_ms=1000)
    for _ in range(5):
        h.report(0, 0, FAILURE, T0)
    granted = run_children(_probe_many, [(h, 500, T0 + 1000)] * 4)
    assert sum(granted) == 3


def _take_places(h: Health, n: int) -> int:
    return sum(h.acquire(0) for _ in range(n))


def test_in_flight_cap_is_global_across_processes() -> None:
    h = health(caps=[7])
    taken = run_children(_take_places, [(h, 100)] * 4)
    assert sum(taken) == 7 and h.in_flight(0) == 7
    assert h.counter(0, _native.UP_FULL) == 400 - 7
    for _ in range(7):
        h.release(0)
    assert h.in_flight(0) == 0


def _hammer_cycle(h: Health, seed: int, steps: int) -> tuple[int, int, int]:
    rng = random.Random(seed)
    opened = reopened = closed = 0
    t = T0
    for _ in range(steps):
        t += rng.randrange(3)
        ticket = h.enter(0, t)
        if ticket < 0:
            continue
        tr = h.report(0, ticket, FAILURE if rng.random() < 0.6 else SUCCESS, t)
        opened += tr == _native.TR_OPENED
        reopened += tr == _native.TR_REOPENED
        closed += tr == _native.TR_CLOSED
    return opened, reopened, closed


def test_no_lost_transitions_across_processes() -> None:
    h = health(failures=3, successes=2, open_ms=20, max_open_ms=80, probes=2,
               probe_lease_ms=10**6)
    results = run_children(_hammer_cycle, [(h, seed, 20_000) for seed in range(4)])
    opened = sum(r[0] for r in results)
    reopened = sum(r[1] for r in results)
    closed = sum(r[2] for r in results)
    state = h.breaker(0, T0)[0]
    assert h.breaker(0, T0)[6] == opened + reopened
    assert opened == closed + (state != _native.BREAKER_CLOSED)
    assert opened > 10 and closed > 10


def test_transitions_are_kept_by_the_process_that_made_them() -> None:
    h = health(failures=2, successes=2)
    assert h.transitions() == ([], 0)
    for k in range(2):  # the second failure in a row opens it
        assert h.allow(0, T0 + k) == 0
        h.finish(0, 0, FAILURE, T0 + k)
    assert h.transitions() == ([(0, _native.TR_OPENED, T0 + 1, 30_000)], 0)
    assert h.transitions() == ([], 0)  # drained
    ticket = h.allow(0, T0 + 30_001)  # due: this admission turns it half-open
    assert ticket > 0 and h.allow(0, T0 + 30_001) == -1
    h.finish(0, ticket, FAILURE, T0 + 30_002)
    assert h.transitions()[0] == [(0, _native.TR_HALF_OPENED, T0 + 30_001, 0),
                                  (0, _native.TR_REOPENED, T0 + 30_002, 60_000)]
    for k in range(2):  # two probe successes close it
        ticket = h.enter(0, T0 + 90_002 + k)
        assert h.report(0, ticket, SUCCESS, T0 + 90_002 + k) == (
            _native.TR_CLOSED if k else _native.TR_NONE)
    assert [e[1] for e in h.transitions()[0]] == [_native.TR_HALF_OPENED, _native.TR_CLOSED]
    for k in range(30):  # 90 transitions, more than it keeps between two drains
        t = T0 + 10**6 * (k + 1)
        h.report(0, 0, FAILURE, t)
        assert h.report(0, 0, FAILURE, t) == _native.TR_OPENED
        for n in range(2):
            assert h.report(0, h.enter(0, t + 30_000 + n), SUCCESS, t + 30_000 + n) == (
                _native.TR_CLOSED if n else _native.TR_NONE)
    events, lost = h.transitions()
    assert len(events) == 64 and lost == 90 - 64  # the overflow is counted, not kept
    assert events[:3] == [(0, _native.TR_OPENED, T0 + 10**6, 30_000),
                          (0, _native.TR_HALF_OPENED, T0 + 10**6 + 30_000, 0),
                          (0, _native.TR_CLOSED, T0 + 10**6 + 30_001, 0)]
    assert h.transitions() == ([], 0)



def _hammer_transitions(h: Health, seed: int, steps: int) -> dict[int, int]:
    """Random traffic; the transitions this process was told of, drained as a worker does."""
    rng = random.Random(seed)
    seen: dict[int, int] = {}
    t = T0
    for step in range(steps):
        t += rng.randrange(3)
        ticket = h.allow(0, t)
        if ticket >= 0:
            h.finish(0, ticket, FAILURE if rng.random() < 0.6 else SUCCESS, t)
        if step % 8 == 0 or step == steps - 1:
            events, lost = h.transitions()
            assert not lost
            for event in events:
                seen[event[1]] = seen.get(event[1], 0) + 1
    return seen


def test_each_transition_is_kept_once_across_processes() -> None:
    h = health(failures=3, successes=2, open_ms=20, max_open_ms=80, probes=1,
               probe_lease_ms=10**6)
    results = run_children(_hammer_transitions, [(h, seed, 20_000) for seed in range(4)])
    total = {tr: sum(r.get(tr, 0) for r in results) for tr in (
        _native.TR_OPENED, _native.TR_REOPENED, _native.TR_HALF_OPENED, _native.TR_CLOSED)}
    state, *_, opens, _until = h.breaker(0, T0)
    openings = total[_native.TR_OPENED] + total[_native.TR_REOPENED]
    assert opens == openings and total[_native.TR_CLOSED] > 10
    # Each opening ended in one half-open transition except one still open; each close
    # ended a cycle that began with one first opening.
    assert total[_native.TR_HALF_OPENED] == openings - (state == _native.BREAKER_OPEN)
    assert total[_native.TR_OPENED] == total[_native.TR_CLOSED] + (
        state != _native.BREAKER_CLOSED)


@pytest.mark.parametrize(
    ("field", "bad"),
    [("failures", 0), ("successes", 256), ("open_ms", 0), ("probes", 64), ("probe_lease_ms", -1)],
)
def test_bad_policy_names_the_argument(field: str, bad: int) -> None:
    with pytest.raises(ValueError, match=field):
        health(**{field: bad})


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_open_ms"):
        health(open_ms=1000, max_open_ms=999)
    with pytest.raises(ValueError, match="max_in_flight"):
        Health([], 5, 2, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="max_in_flight"):
        Health([-1], 5, 2, 1, 1, 1, 1)
    with pytest.raises(TypeError):
        Health(5, 5, 2, 1, 1, 1, 1)  # type: ignore[arg-type]
    h = health(2)
    with pytest.raises(IndexError):
        h.enter(2)
    with pytest.raises(ValueError, match="outcome"):
        h.report(0, 0, 3)
    with pytest.raises(ValueError, match="now_ms"):
        h.peek(0, -5)
    with pytest.raises(ValueError, match="percent"):
        RetryBudget(-1, 10, 1)
    with pytest.raises(ValueError, match="window_s"):
        RetryBudget(20, 0, 1)
    with pytest.raises(ValueError, match="weights"):
        Rendezvous([1, 2], [1.0, 0.0])
    with pytest.raises(ValueError):
        Rendezvous([1], [1.0, 2.0])


# ------------------------------------------------------------------------------ budget


def test_budget_percent_plus_floor_over_the_window() -> None:
    b = RetryBudget(20, 10, 1)  # 20% of requests + 1/s x 10 s
    for _ in range(100):
        b.record_request(T0)
    granted = sum(b.try_retry(T0) for _ in range(100))
    assert granted == 20 + 10
    assert b.window(T0) == (100, 30)
    # 10 s later the first second has left the window: only the floor remains.
    assert sum(b.try_retry(T0 + 10_000) for _ in range(100)) == 10


def _retry_many(b: RetryBudget, n: int, now: int) -> int:
    return sum(b.try_retry(now) for _ in range(n))


def test_budget_is_exact_across_processes() -> None:
    b = RetryBudget(25, 10, 0)
    for _ in range(2000):
        b.record_request(T0)
    granted = run_children(_retry_many, [(b, 300, T0)] * 4)
    assert sum(granted) == 500  # 25% of 2000, however the processes raced


def _requests_and_retries(b: RetryBudget, seed: int,
                          steps: int) -> tuple[dict[int, int], dict[int, int]]:
    rng = random.Random(seed)
    req: dict[int, int] = {}
    ret: dict[int, int] = {}
    t = T0
    for _ in range(steps):
        t += rng.randrange(2)
        if rng.random() < 0.7:
            s = b.record_request(t)
            if s >= 0:
                req[s] = req.get(s, 0) + 1
        else:
            s = b._try_retry_at(t)
            if s >= 0:
                ret[s] = ret.get(s, 0) + 1
    return req, ret


def test_budget_never_exceeded_across_processes_with_moving_clock() -> None:
    b = RetryBudget(10, 3, 1)
    results = run_children(_requests_and_retries, [(b, seed, 30_000) for seed in range(4)])
    req: dict[int, int] = {}
    ret: dict[int, int] = {}
    for r, g in results:
        for s, n in r.items():
            req[s] = req.get(s, 0) + n
        for s, n in g.items():
            ret[s] = ret.get(s, 0) + n
    assert ret
    for s in ret:
        window = range(s - 2, s + 1)
        retries = sum(ret.get(k, 0) for k in window)
        requests = sum(req.get(k, 0) for k in window)
        assert 100 * retries <= 10 * requests + 100 * 1 * 3, (s, retries, requests)


# ------------------------------------------------------------------------------ hashes


def test_hash64_is_stable_across_processes_and_types() -> None:
    assert hash64(b"user-42") == 0x75B98791053D57CE  # the C test pins the same value
    assert hash64(memoryview(b"user-42")) == hash64(bytearray(b"user-42")) == hash64(b"user-42")
    assert run_children(hash64, [(b"user-42",)]) == [hash64(b"user-42")]
    assert hash64(b"a", 1) != hash64(b"a", 2)
    with pytest.raises(TypeError):
        hash64("text")  # type: ignore[arg-type]


def test_rendezvous_rank_is_a_permutation_best_first() -> None:
    r = Rendezvous([hash64(b"a"), hash64(b"b"), hash64(b"c")], [1.0, 1.0, 1.0])
    for k in range(200):
        order = r.rank(hash64(b"%d" % k))
        assert sorted(order) == [0, 1, 2] and order[0] == r.first(hash64(b"%d" % k))


# ------------------------------------------------------------------------------ SharedHealth


def make_tables(n: int = 2, rpm: int = 0, max_in_flight: int = 0, failures: int = 3) -> Tables:
    ups = tuple(UpstreamSpec(f"u{i}", f"https://u{i}.test", rpm=rpm, max_in_flight=max_in_flight)
                for i in range(n))
    route = RouteSpec("m", tuple(TargetSpec(f"u{i}") for i in range(n)))
    return Tables(ups, (route,), RetryPolicy(attempts=2),
                  BreakerPolicy(failures=failures, open_s=30, max_open_s=300, successes=1))


def test_shared_health_admit_finish_round_trip_and_snapshot() -> None:
    h = SharedHealth.create(make_tables(max_in_flight=1))
    t = now_ms()
    ticket = h.allow(0, t)
    assert ticket == 0 and h.in_flight(0) == 1
    assert h.allow(0, t) == -REASON_FULL and h.check(0, t) == REASON_FULL
    h.finish(0, ticket, SUCCESS, t)
    snap = h.snapshot(t)
    row = snap["upstreams"]["u0"]
    assert row["in_flight"] == 0 and row["requests"] == 1 and row["successes"] == 1
    assert row["refused_full"] == 1 and row["state"] == "closed" and row["max_in_flight"] == 1
    assert snap["retry_budget"]["window_s"] == 10


def test_shared_health_rpm_bucket_refuses_then_429() -> None:
    h = SharedHealth.create(make_tables(n=1, rpm=6))  # burst 1
    router = Router(make_tables(n=1, rpm=6), h)
    plan = router.plan("m")
    assert plan is not None
    a = plan.first()
    assert not isinstance(a, Exception)
    plan.finish(a, SUCCESS)
    refused = router.plan("m").first()  # type: ignore[union-attr]
    assert isinstance(refused, RateLimited) and 1 <= refused.retry_after_s <= 10
    assert h.in_flight(0) == 0
    assert h.allow(0, now_ms()) == -REASON_RATE


def _worker_fails(h: SharedHealth, tables: Tables, n: int) -> list[int]:
    """A worker process: n requests, each failing with a 503 on its first target."""
    router = Router(tables, h, rng=random.Random(os.getpid()))
    seen = []
    for _ in range(n):
        plan = router.plan("m")
        assert plan is not None
        a = plan.first()
        assert not isinstance(a, Exception)
        seen.append(a.upstream)
        if a.upstream == 0:
            nxt = plan.retry(a, verdict_of(Event.RESPONSE, 503))
            if nxt is not None:
                plan.finish(nxt, SUCCESS)
        else:
            plan.finish(a, SUCCESS)
    return seen


def test_one_workers_failures_protect_the_others() -> None:
    tables = make_tables(n=2, failures=3)
    h = SharedHealth.create(tables)
    # Worker A sees u0 fail until its breaker opens.
    run_children(_worker_fails, [(h, tables, 20)])
    snap = h.snapshot()["upstreams"]
    assert snap["u0"]["state"] == "open" and snap["u0"]["open_count"] == 1
    assert snap["u0"]["failures"] == 3  # nothing was sent to u0 once it opened
    # Workers B and C, forked later from the same supervisor state, never send to u0.
    seen = run_children(_worker_fails, [(h, tables, 50), (h, tables, 50)])
    assert all(u == 1 for worker in seen for u in worker)
    assert h.in_flight(0) == 0 and h.in_flight(1) == 0


def test_panic_through_shared_health_when_all_open() -> None:
    tables = make_tables(n=2, failures=1)
    h = SharedHealth.create(tables)
    t = now_ms()
    h.finish(1, h.allow(1, t), FAILURE, t - 1000)  # u1 opened first (at t - 1000)
    h.finish(0, h.allow(0, t), FAILURE, t)
    router = Router(tables, h)
    plan = router.plan("m")
    a = plan.first(t)  # type: ignore[union-attr]
    assert not isinstance(a, Exception)
    assert a.panic and a.upstream == 1
    assert h.snapshot(t)["upstreams"]["u1"]["panics"] == 1
    plan.finish(a, NEUTRAL, t)  # type: ignore[union-attr]
    assert h.in_flight(1) == 0


def test_needs_probe_lists_due_breakers_and_a_probe_closes_it() -> None:
    tables = make_tables(n=2, failures=1)
    h = SharedHealth.create(tables)
    t = now_ms()
    assert h.needs_probe(t) == []
    h.finish(0, h.allow(0, t), FAILURE, t)
    assert h.needs_probe(t) == [] and h.needs_probe(t + 29_999) == []
    assert h.needs_probe(t + 30_000) == [0]
    ticket = h.allow(0, t + 30_000)
    assert ticket > 0 and h.needs_probe(t + 30_001) == []  # the probe slot is taken
    h.finish(0, ticket, SUCCESS, t + 30_002)  # successes=1 in make_tables
    assert h.snapshot(t + 30_002)["upstreams"]["u0"]["state"] == "closed"


def test_bad_policies_in_tables_name_the_table() -> None:
    bad = Tables(make_tables().upstreams, make_tables().routes, source="gw.toml",
                 breaker=BreakerPolicy(open_s=0))
    with pytest.raises(TableError, match=r"gw.toml: \[breaker\] open_s must be .* got 0"):
        SharedHealth.create(bad)
    bad = Tables(make_tables().upstreams, make_tables().routes, source="gw.toml",
                 retry=RetryPolicy(budget_window_s=0))
    with pytest.raises(TableError, match=r"gw.toml: \[retry\] budget_window_s .* got 0"):
        SharedHealth.create(bad)


def test_group_calls_match_single_calls_and_refuse_bad_input() -> None:
    h = health(3, caps=[1, 0, 0])
    assert h.usable_mask((0, 1, 2), T0) == 0b111
    assert h.allow(0, T0) == 0 and h.in_flight_sum((0, 1, 2)) == 1
    assert h.usable_mask((0, 1, 2), T0) == 0b110  # 0 is full
    assert h.usable_mask((2, 0), T0) == 0b01  # bits follow the tuple's order
    assert h.allow(0, T0) == -REASON_FULL
    for _ in range(5):
        h.report(1, 0, FAILURE, T0)
    assert h.usable_mask((0, 1, 2), T0) == 0b100 and h.allow(1, T0) == -REASON_OPEN
    h.finish(0, 0, SUCCESS, None)
    assert h.in_flight_sum((0, 1, 2)) == 0 and h.counter(0, _native.UP_SUCCESSES) == 1
    with pytest.raises(TypeError):
        h.usable_mask([0, 1], T0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        h.usable_mask(tuple(range(65)), T0)
    with pytest.raises(IndexError):
        h.usable_mask((0, 3), T0)
    with pytest.raises(IndexError):
        h.in_flight_sum((7,))


def _maps() -> int:
    with open("/proc/self/maps") as fh:
        return sum(1 for _ in fh)


def test_create_destroy_unmaps_shared_memory() -> None:
    before = _maps()
    for _ in range(5000):
        Health([0, 0], 5, 2, 1000, 1000, 1, 1000).enter(0)
        RetryBudget(20, 10, 1).try_retry()
    assert _maps() - before < 20
