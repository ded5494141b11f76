"""The lease script (velox.cluster.leases.LEASE_LUA) run by a real Redis: the shared bucket's rules.

Each test talks to its own redis-server through redis-py (sync client), exactly the way the
refresher does (EVALSHA of the same script), without any Velox process.
"""

from __future__ import annotations

import time

import pytest
import redis

from velox.cluster import leases as cluster
from velox_lab.launch import RedisProcess


@pytest.fixture
def client(redis_server: RedisProcess) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url)


def lease(client: redis.Redis, host: str, *buckets: tuple[str, int, int, int],
          leave: bool = False, ttl_ms: int = 5000, called_before: bool = False) -> list[int]:
    keys = [*cluster.FIXED_KEYS] + [cluster.KEY_PREFIX + "bucket:" + b[0] for b in buckets]
    args: list[object] = [host, ttl_ms, "1" if leave else "0", "1" if called_before else "0"]
    for _, rate, burst, want in buckets:
        args += [rate, burst, want]
    return [int(x) for x in client.eval(cluster.LEASE_LUA, len(keys), *keys, *args)]


def test_a_new_bucket_starts_full_and_grants_at_most_its_level(client: redis.Redis) -> None:
    hosts, granted, wait = lease(client, "a", ("k", 600, 10, 4))
    assert (hosts, granted, wait) == (1, 4, 0)
    _, granted, wait = lease(client, "a", ("k", 600, 10, 20))
    assert granted == 6  # 10 - 4, plus at most a fraction refilled meanwhile
    # 14 short at 10 tokens/s: the script says when they will be there (about 1.4 s).
    assert 1000 <= wait <= 1500


def test_refill_follows_redis_time_at_the_configured_rate(client: redis.Redis) -> None:
    lease(client, "a", ("k", 6000, 100, 100))  # empty it: 100 tokens/s from now
    time.sleep(0.3)
    _, granted, _ = lease(client, "a", ("k", 6000, 100, 100))
    assert 25 <= granted <= 60  # 0.3 s x 100/s = 30, with a busy box's scheduling slack


def test_returned_tokens_go_back_capped_at_burst(client: redis.Redis) -> None:
    lease(client, "a", ("k", 60, 10, 10))
    lease(client, "a", ("k", 60, 10, -7))  # a leaving host returns 7
    _, granted, _ = lease(client, "a", ("k", 60, 10, 10))
    assert granted == 7
    lease(client, "a", ("k", 60, 10, -50))  # returns never lift it past burst
    _, granted, _ = lease(client, "a", ("k", 60, 10, 50))
    assert granted == 10


def test_hosts_register_expire_and_leave(client: redis.Redis) -> None:
    assert lease(client, "a")[0] == 1
    assert lease(client, "b")[0] == 2
    assert lease(client, "a", leave=True)[0] == 1
    assert lease(client, "c", ttl_ms=200)[0] == 2
    time.sleep(0.35)  # b and c silent for longer than the TTL
    assert lease(client, "d", ttl_ms=200)[0] == 1


def test_several_buckets_in_one_call_are_independent(client: redis.Redis) -> None:
    hosts, g1, _, g2, _, g3, _ = lease(client, "a", ("x", 60, 3, 5), ("y", 60, 8, 5),
                                       ("z", 60, 8, 0))
    assert (hosts, g1, g2, g3) == (1, 3, 5, 0)


@pytest.mark.parametrize("rate,burst", [(1, 1), (10**9, 10**9)])
def test_extreme_limits_stay_exact(client: redis.Redis, rate: int, burst: int) -> None:
    _, granted, _ = lease(client, "a", ("k", rate, burst, burst))
    assert granted == burst
    _, granted, _ = lease(client, "a", ("k", rate, burst, 1))
    assert granted <= (1 if rate == 10**9 else 0)


def test_after_a_data_loss_new_buckets_start_empty(client: redis.Redis,
                                                   redis_server: RedisProcess) -> None:
    # A first deployment: buckets start full, even for a host that says it called before
    # as long as Redis still has the hosts' state.
    assert lease(client, "a", ("k", 600, 10, 10))[1] == 10
    assert lease(client, "a", ("j", 600, 10, 10), called_before=True)[1] == 10
    redis_server.kill()  # SIGKILL: no persistence, everything is gone
    redis_server.start()
    fresh = redis.Redis.from_url(redis_server.url)
    # A host that never called (a new deployment) would get a full bucket; one that called
    # before sees the state gone: its buckets start empty and only refill.
    _hosts, granted, wait = lease(fresh, "a", ("k", 600, 10, 10), called_before=True)
    assert granted <= 1 and wait > 0
    assert lease(fresh, "b", ("j", 600, 10, 10))[1] <= 1  # also for the hosts after it
    assert fresh.pttl(cluster.LOST_KEY) > (cluster.LOST_S - 5) * 1000


def test_lease_cap_and_bound() -> None:
    # 600 rpm on 3 hosts: 10/s, a second's share is 3.33 -> 4 tokens per host, 12 in all.
    assert cluster.lease_cap(600, 100, 3) == 4
    assert cluster.bound(600, 100, 3) == 12
    assert cluster.lease_cap(6, 1, 3) == 1  # low rates: one token per host
    assert cluster.lease_cap(600_000, 50, 1) == 50  # never more than the burst
    assert cluster.fallback_share(600, 100, 3) == (200, 33)
    assert cluster.fallback_share(2, 1, 3) == (1, 1)
