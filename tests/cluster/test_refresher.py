"""The host's refresher (velox.cluster.leases.Cluster) against a real Redis: leases, hosts,
fallback.

Each "host" is a Cluster in this process with its own local buckets; the local buckets are
native `Limits` entries, as in the gateway.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from velox.cluster import leases as cluster
from velox_lab.launch import RedisProcess

from .limits import local_limits


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


@pytest.fixture
def hosts(redis_server: RedisProcess) -> Iterator[Callable[..., cluster.Cluster]]:
    made: list[cluster.Cluster] = []

    def make(rate: int = 600, burst: int = 20, name: str = "gw") -> cluster.Cluster:
        c = cluster.Cluster(redis_server.url, host_id=f"host-{len(made)}")
        c.add(name, local_limits(1), 0, rate, burst)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def drain(c: cluster.Cluster, seconds: float) -> int:
    """Take every token the host gets for `seconds` (a demand above any limit)."""
    b = c.buckets[0]
    got = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        while b.limits.take(b.index, 1) == 0:
            got += 1
        time.sleep(0.002)
    return got


def test_a_host_gets_leases_and_its_workers_take_from_them(hosts: Callable[..., Any]) -> None:
    c = hosts(rate=600, burst=20)
    c.start()
    assert c.up and c.hosts == 1
    b = c.buckets[0]
    assert b.cap == 10  # a second of 600 rpm on one host
    wait_for(lambda: b.limits.level(0) >= 1)
    got = drain(c, 2.0)
    # burst 20 + 10/s for 2 s (plus the leases' rounding) and not much below.
    assert 20 + 10 <= got <= 20 + 20 + cluster.bound(600, 20, 1)
    assert c.commands >= c.lease_requests // 500 + 1
    assert c.leased_tokens >= got


def test_three_hosts_share_one_limit_within_the_bound(hosts: Callable[..., Any]) -> None:
    rate, burst = 1200, 30
    group = [hosts(rate=rate, burst=burst) for _ in range(3)]
    for c in group:
        c.start()
    wait_for(lambda: all(c.hosts == 3 for c in group))
    # All three drain at once, each as fast as it can, for 3 s.
    import threading

    counts = [0, 0, 0]

    def run(i: int) -> None:
        counts[i] = drain(group[i], 3.0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    total = sum(counts)
    stated = cluster.bound(rate, burst, 3)
    upper = burst + rate / 60 * elapsed + stated
    lower = burst + rate / 60 * 3.0 - stated - rate / 60 * 0.5  # minus half a second of start
    assert lower <= total <= upper, (counts, lower, upper)
    assert all(n > 0 for n in counts)


def test_redis_down_falls_back_to_the_share_and_comes_back(
        hosts: Callable[..., Any], redis_server: RedisProcess,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="velox.cluster")
    a, b = hosts(rate=600, burst=20), hosts(rate=600, burst=20)
    a.start()
    b.start()
    wait_for(lambda: a.hosts == 2 and b.hosts == 2)
    redis_server.kill()
    wait_for(lambda: not a.up and not b.up)
    assert a.fallbacks == 1
    # The local bucket now refills by itself at the host's share: 300 rpm, burst 10.
    got = drain(a, 2.0)
    assert got <= 10 + 5 * 2.0 + cluster.lease_cap(600, 20, 2) + 1
    assert got >= 5
    time.sleep(1.0)  # several failed retries: still one fallback, one log line
    assert a.fallbacks == 1
    downs = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(downs) == 2  # one per host
    assert "limit / 2 host(s)" in downs[0].getMessage()
    redis_server.start()
    wait_for(lambda: a.up and b.up, timeout=5)
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    # The restarted Redis lost the hosts' set: it is whole again within a heartbeat.
    wait_for(lambda: a.hosts == 2 and a.buckets[0].cap == cluster.lease_cap(600, 20, 2),
             timeout=3)
    wait_for(lambda: a.buckets[0].limits.level(0) >= 1)


def test_a_stopping_host_returns_its_tokens_and_leaves(
        hosts: Callable[..., Any], redis_server: RedisProcess) -> None:
    a, b = hosts(rate=6000, burst=50), hosts(rate=6000, burst=50)
    a.start()
    b.start()
    wait_for(lambda: a.hosts == 2)
    wait_for(lambda: a.buckets[0].limits.level(0) >= 1)
    a.stop()
    assert a.buckets[0].limits.level(0) == 0  # handed back to Redis, not kept
    wait_for(lambda: b.hosts == 1, timeout=3)


def test_unreachable_at_start_means_the_share_at_once(tmp_path: Any) -> None:
    from velox_lab.launch import free_port

    c = cluster.Cluster(f"redis://127.0.0.1:{free_port()}/0", host_id="lonely")
    limits = local_limits(1)
    c.add("gw", limits, 0, 600, 20)
    try:
        c.start()
        assert not c.up and c.fallbacks == 1
        # One host was ever seen (itself): the whole limit, refilled by the clock.
        assert limits.level(0) == 20
    finally:
        c.stop()


def test_a_take_larger_than_a_lease_gets_leased_once(redis_server: RedisProcess) -> None:
    """A tpm reservation bigger than the lease cap (600 tpm on one host: 10 tokens a lease)
    is refused once and counted as demand by the bucket itself (native: refused tokens and
    the largest take); the next lease covers it, so it can pass, and the host keeps enough in
    hand for the next one of that size on top of the rate's lease."""
    c = cluster.Cluster(redis_server.url, host_id="big")
    limits = local_limits(2)
    c.add("key:k:tpm", limits, 1, 600, 600)
    try:
        c.start()
        assert c.buckets[0].cap == 10
        time.sleep(0.5)
        assert limits.take(1, 50) > 0  # more than any lease: refused, and noted natively
        assert limits.refused(1) == 50
        wait_for(lambda: limits.level(1) >= 50, timeout=3)
        assert limits.take(1, 50) == 0
        assert limits.pop_largest(1) <= 50  # popped by the refresher every tick
        # Given back (a settled reservation), it stays in hand: not leased again and again.
        # The host keeps the refused take and one more of its size (requests arriving at once
        # are counted: the refused one beside the largest) on top of a lease: 2 x 50 + 10.
        limits.refund(1, 45)
        time.sleep(0.5)
        assert 45 <= limits.level(1) <= 2 * 50 + 10
    finally:
        c.stop()


def test_a_bucket_that_was_full_holds_leased_tokens_only_after_its_first_lease(
        redis_server: RedisProcess) -> None:
    """A key's bucket is made full (a clock bucket) before the refresher takes it over: until
    its first lease it serves the host's share (one host known: the burst), then what is left
    of it is dropped, or each host would keep a burst of its own; only leases fill it."""
    limits = local_limits(1)
    limits.configure(0, 600, 600)
    c = cluster.Cluster(redis_server.url, host_id="full")
    c.add("key:k:rpm", limits, 0, 600, 600)
    assert limits.level(0) == 600 and c.buckets[0].provisional
    try:
        c.start()
        wait_for(lambda: not c.buckets[0].provisional)
        assert limits.level(0) <= c.buckets[0].cap
    finally:
        c.stop()


def test_a_bucket_added_while_up_holds_a_few_tokens_after_its_first_lease(
        redis_server: RedisProcess) -> None:
    """A new key's bucket has seen no demand when its first lease is asked: that lease is
    still at least FIRST_LEASE tokens (within the lease cap), so the requests right after it
    find tokens (a one-token first lease left it empty until the next tick: a new key's third
    request on a second host was refused)."""
    c = cluster.Cluster(redis_server.url, host_id="first-lease")
    c.add("gw", local_limits(1), 0, 600, 20)
    try:
        c.start()
        assert c.up
        limits = local_limits(1)
        c.add("key:fresh:rpm", limits, 0, 600, 600)
        b = next(x for x in c.buckets if x.name == "key:fresh:rpm")
        wait_for(lambda: not b.provisional, timeout=10)
        assert limits.level(0) >= 2, (limits.level(0), b.cap)  # cap: 10 at 600 rpm, one host
    finally:
        c.stop()


def test_a_bucket_added_while_up_serves_the_share_until_its_first_lease_and_owes_it(
        redis_server: RedisProcess) -> None:
    """A key made at run time on a host already sharing its limits: its buckets are added
    while the refresher runs. Its first requests are served from the host's fallback share
    (not refused until the first lease arrives: a busy host's refresher may take seconds),
    and what they took is charged to the Redis bucket once the lease arrives."""
    import redis

    c = cluster.Cluster(redis_server.url, host_id="runtime")
    c.add("gw", local_limits(1), 0, 600, 20)
    client = redis.Redis.from_url(redis_server.url)
    try:
        c.start()
        assert c.up
        limits = local_limits(1)
        added = time.monotonic()
        c.add("key:new:rpm", limits, 0, 600, 600)
        for _ in range(100):  # before any lease: the share of one host is the whole burst
            assert limits.take(0, 1) == 0
        b = next(x for x in c.buckets if x.name == "key:new:rpm")
        wait_for(lambda: not b.provisional and b.owed == 0, timeout=10)
        level = float(client.hget(cluster.KEY_PREFIX + "bucket:key:new:rpm", "l") or 0)
        refill = 10 * (time.monotonic() - added) + 1  # 600 rpm: 10 a second
        # Redis gave out at least the 100 taken: what it and the host hold is 600 less them.
        assert level + limits.level(0) <= 600 - 100 + refill
        # Added again (new limits) it had leases: leased tokens only, from empty.
        c.add("key:new:rpm", limits, 0, 300, 300)
        assert limits.level(0) == 0 and not c.buckets[-1].provisional
    finally:
        client.close()
        c.stop()
