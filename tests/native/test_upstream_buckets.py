"""The upstreams' rpm buckets as entries of one native Limits (velox.state.health.SharedHealth.rpm),
and what the Redis refresher needs of them and of the tpm buckets: socket-free.

Checked here: one Limits for all upstreams with the same bursts as before (10 s of rpm), only
upstreams with an rpm configured; a bucket shared by forked workers; a LEASED bucket (what
velox.cluster.leases makes of it) admitting exactly what was given, then refusing with Retry-After
1; the tpm refusal counted by the bucket for the refresher; and the supervisor registering every
upstream's rpm and tpm bucket under `upstream:<name>:rpm|tpm` with the right indexes (a Cluster
never started: no Redis, no socket).
"""

from __future__ import annotations

from types import SimpleNamespace

from tests.native.test_health import run_children
from velox.cluster import leases as cluster
from velox.config.tables import RetryPolicy, RouteSpec, Tables, TargetSpec, UpstreamSpec
from velox.core.clock import now_ms
from velox.core.errors import RateLimited
from velox.routing.balance import Router
from velox.state.health import REASON_RATE, SUCCESS, SharedHealth, UpstreamTokens, rpm_burst
from velox.state.stats import SharedStats
from velox.supervisor import Supervisor


def tables(*rates: tuple[int, int]) -> Tables:
    """One upstream per (rpm, tpm), u0, u1, ..., all targets of route m."""
    ups = tuple(UpstreamSpec(f"u{i}", f"https://u{i}.test", rpm=rpm, tpm=tpm)
                for i, (rpm, tpm) in enumerate(rates))
    route = RouteSpec("m", tuple(TargetSpec(u.name) for u in ups))
    return Tables(ups, (route,), RetryPolicy(attempts=2))


def test_rpm_buckets_are_one_limits_with_the_same_bursts() -> None:
    h = SharedHealth.create(tables((600, 0), (0, 0), (6, 0)))
    assert h.rpm.config(0) == (600, rpm_burst(600)) == (600, 100)
    assert h.rpm.config(1) == (0, 0)  # no rpm: no bucket, never taken from
    assert h.rpm.config(2) == (6, 1)
    t = now_ms()
    for _ in range(100):  # the burst, then refused without a refill to speak of (10/s)
        h.finish(0, h.allow(0, t), SUCCESS, t)
    assert h.allow(0, t) == -REASON_RATE
    assert h.in_flight(0) == 0  # a refusal holds no place
    for _ in range(200):  # no bucket: never refused for rate
        assert h.allow(1, t) >= 0
        h.finish(1, 0, SUCCESS, t)
    assert h.rpm.taken(1) == 0


def _take_all(h: SharedHealth) -> int:
    t = now_ms()
    n = 0
    while n < 1000 and h.allow(0, t) >= 0:
        h.finish(0, 0, SUCCESS, t)
        n += 1
    return n


def test_forked_workers_share_one_rpm_bucket() -> None:
    h = SharedHealth.create(tables((60, 0)))  # burst 10, 1 token a second
    got = run_children(_take_all, [(h,), (h,), (h,)])
    # One bucket: its burst between them (plus at most the refill while they ran), not 3 x 10.
    assert 10 <= sum(got) <= 12, got


def test_a_leased_rpm_bucket_admits_what_was_given_then_429_retry_after_1() -> None:
    t = tables((120, 0))
    h = SharedHealth.create(t)
    h.rpm.configure(0, 0, rpm_burst(120))  # what the refresher does (rate 0: only give fills)
    assert h.rpm.level(0) == 20  # the level is kept (a later configure); drop it like add()
    assert h.rpm.take(0, 20) == 0
    router = Router(t, h)
    plan = router.plan("m")
    assert plan is not None
    refused = plan.first()
    assert isinstance(refused, RateLimited) and refused.retry_after_s == 1
    assert h.retry_after_s(0) == 1  # a leased bucket waits for the next lease, not the clock
    assert h.rpm.give(0, 2) == 2
    for _ in range(2):
        p = router.plan("m")
        a = p.first()  # type: ignore[union-attr]
        assert not isinstance(a, Exception)
        p.finish(a, SUCCESS)  # type: ignore[union-attr]
    assert isinstance(router.plan("m").first(), RateLimited)  # type: ignore[union-attr]
    assert h.rpm.taken(0) == 20 + 2  # the drained level, then the two admitted


def test_retry_after_of_a_clock_bucket_counts_whole_seconds_to_the_next_token() -> None:
    h = SharedHealth.create(tables((6, 0)))  # burst 1, one token every 10 s
    t = now_ms()
    assert h.allow(0, t) >= 0
    assert 1 <= h.retry_after_s(0) <= 10


def test_a_refused_tpm_reservation_is_noted_for_the_next_lease() -> None:
    tokens = UpstreamTokens((0, 6000))
    tokens.limits.configure(1, 0, 6000)  # leased (the level is kept: drop it, as add() does)
    assert tokens.limits.take(1, 6000) == 0
    tokens.limits.pop_largest(1)
    assert tokens.reserve(1, 500) == (0, 1_000_000)  # a lease's wait
    # The bucket itself counts the demand the refresher leases for (velox.cluster.leases).
    assert tokens.limits.refused(1) == 500 and tokens.limits.pop_largest(1) == 500
    tokens.limits.give(1, 500)
    assert tokens.reserve(1, 500) == (500, 0)
    assert tokens.reserve(0, 500) == (0, 0) and tokens.limits.refused(0) == 0


def test_supervisor_registers_each_upstreams_rpm_and_tpm_bucket_by_name() -> None:
    shared = SharedStats(1, tables((120, 0), (0, 6000), (60, 600), (0, 0)))
    c = cluster.Cluster("redis://127.0.0.1:1/0", host_id="test")  # never started
    fake = SimpleNamespace(cluster=c, _typical_reservation=lambda: 2048)
    Supervisor._share_upstreams(fake, shared)  # type: ignore[arg-type]
    health = shared.health
    assert health.tpm is not None
    got = {b.name: (b.limits, b.index, b.rate, b.burst, b.need) for b in c.buckets}
    # A tpm bucket keeps a typical reservation in hand (at most its burst); rpm takes are 1.
    assert got == {
        "upstream:u0:rpm": (health.rpm, 0, 120, 20, 0),
        "upstream:u1:tpm": (health.tpm.limits, 1, 6000, 6000, 2048),
        "upstream:u2:rpm": (health.rpm, 2, 60, 10, 0),
        "upstream:u2:tpm": (health.tpm.limits, 2, 600, 600, 600),
    }
    # Until the refresher's first lease each bucket serves the host's share, full, as during a
    # Redis outage (one host: Redis never reached), so a new bucket never refuses its first
    # requests for want of a lease.
    assert health.rpm.config(0) == cluster.fallback_share(120, 20, 1)
    assert health.rpm.level(0) == cluster.fallback_share(120, 20, 1)[1]
    assert health.tpm.limits.config(1) == cluster.fallback_share(6000, 6000, 1)
    assert health.tpm.limits.level(1) == cluster.fallback_share(6000, 6000, 1)[1]
    # A reload's new health replaces them (same names, the new Limits), nothing left behind.
    reloaded = shared.with_tables(tables((120, 0)))
    Supervisor._share_upstreams(fake, reloaded)  # type: ignore[arg-type]
    assert [(b.name, b.limits) for b in c.buckets] == [("upstream:u0:rpm",
                                                         reloaded.health.rpm)]
