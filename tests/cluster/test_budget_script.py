"""The budgets' script (velox.spend.hosts.BUDGET_LUA) run by a real Redis: grants keep every
host's used plus held within the budget, reports are absolute (a repeated one changes
nothing), a lost hash is rebuilt from the hosts' reports and held meanwhile, a silent host's
allowance stops counting. No Velox process: redis-py calls the script as the refresher does.
"""

from __future__ import annotations

import time

import pytest
import redis

from velox.cluster import leases
from velox.spend import hosts as budget_hosts
from velox_lab.launch import RedisProcess

KEY = leases.KEY_PREFIX + "budget:key:k:day:2026-11-26"


@pytest.fixture
def client(redis_server: RedisProcess) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url)


def call(client: redis.Redis, host: str, size: int, used: int, held: int, want: int,
         known: bool = False, ttl_ms: int = 5000, hold_ms: int = 2500,
         key: str = KEY) -> tuple[int, int, int]:
    reply = client.eval(budget_hosts.BUDGET_LUA, 2, leases.LOST_KEY, key, host, ttl_ms,
                        hold_ms, size, used, held, want, 1 if known else 0, 86_400_000)
    granted, left, held_back = (int(x) for x in reply)
    return granted, left, held_back


def test_grants_stop_at_the_budget_across_hosts(client: redis.Redis) -> None:
    assert call(client, "a", 100, 0, 0, 30) == (30, 70, 0)
    assert call(client, "b", 100, 0, 0, 30) == (30, 40, 0)
    # a spent 25 of its 30 (used 25, holds 5): the sum is unchanged, 40 left
    assert call(client, "a", 100, 25, 5, 0) == (0, 40, 0)
    assert call(client, "c", 100, 0, 0, 50) == (40, 0, 0)  # only what is left
    assert call(client, "b", 100, 30, 0, 10) == (0, 0, 0)
    # b's request settled below its estimate: used 12 of the 30 it reserved; 18 left again
    assert call(client, "b", 100, 12, 0, 10) == (10, 8, 0)


def test_reports_are_absolute_a_repeat_changes_nothing(client: redis.Redis) -> None:
    call(client, "a", 100, 0, 0, 40)
    for _ in range(3):
        assert call(client, "a", 100, 30, 10, 0) == (0, 60, 0)


def test_a_debt_counts_and_blocks_grants(client: redis.Redis) -> None:
    call(client, "a", 100, 0, 0, 50)
    # a admitted requests past its allowance: used 120 (estimates), holds nothing
    assert call(client, "a", 100, 120, 0, 0) == (0, -20, 0)
    assert call(client, "b", 100, 0, 0, 10) == (0, -20, 0)


def test_a_lost_hash_is_rebuilt_and_held_meanwhile(client: redis.Redis) -> None:
    call(client, "a", 100, 0, 0, 40)
    call(client, "b", 100, 0, 0, 40)
    call(client, "a", 100, 35, 5, 0)
    call(client, "b", 100, 20, 20, 0)
    client.flushall()  # Redis restarted without its data
    # a had reported before: the hash is held (no grant) until every host has re-reported
    assert call(client, "a", 100, 35, 5, 20, known=True) == (0, 60, 1)
    assert call(client, "b", 100, 20, 20, 0, known=True) == (0, 20, 1)
    # once the hold is over, the rebuilt sum decides: 20 left, not 60
    client.hset(KEY, "hold", 0)
    assert call(client, "a", 100, 35, 5, 50, known=True) == (20, 0, 0)


def test_a_new_hash_after_the_lost_flag_is_held_too(client: redis.Redis) -> None:
    client.set(leases.LOST_KEY, "1")
    assert call(client, "new", 100, 0, 0, 10)[2] == 1
    assert call(client, "new", 100, 0, 0, 10, key=KEY + ":other", hold_ms=0)[0] == 10


def test_a_silent_host_allowance_stops_counting_its_use_does_not(client: redis.Redis) -> None:
    call(client, "gone", 100, 0, 0, 50, ttl_ms=200)
    call(client, "gone", 100, 30, 20, 0, ttl_ms=200)
    time.sleep(0.35)  # longer than the TTL: its 20 held no longer count, its 30 used do
    assert call(client, "a", 100, 0, 0, 100, ttl_ms=200) == (70, 0, 0)


def test_the_hash_expires_after_its_period(client: redis.Redis) -> None:
    call(client, "a", 100, 0, 0, 10)
    assert 0 < client.pttl(KEY) <= 86_400_000
    reply = client.eval(budget_hosts.BUDGET_LUA, 2, leases.LOST_KEY, KEY + ":total", "a", 5000,
                        2500, 100, 0, 0, 10, 0, 0)
    assert int(reply[0]) == 10
    assert client.pttl(KEY + ":total") == -1  # a `total` budget never expires


def test_replies_of_another_shape_are_refused() -> None:
    with pytest.raises(leases.ReplyShapeError):
        budget_hosts.replies([b"OK"], [1])
    with pytest.raises(leases.ReplyShapeError):
        budget_hosts.replies([[1, 2]], [1])
    assert budget_hosts.replies([[1, 2, 0, 3, 4, 1]], [2]) == [(1, 2, 0), (3, 4, 1)]


def test_allowance_ask() -> None:
    # a second of demand, capped; at least the largest estimate; asked at half the target
    assert budget_hosts.allowance_ask(10.0, 0, 100, 1000, 0) == 10
    assert budget_hosts.allowance_ask(500.0, 0, 100, 1000, 0) == 100
    assert budget_hosts.allowance_ask(0.0, 40, 100, 1000, 0) == 40
    assert budget_hosts.allowance_ask(10.0, 0, 100, 1000, 6) == 0
    assert budget_hosts.allowance_ask(10.0, 0, 100, 1000, 5) == 5
    assert budget_hosts.allowance_ask(0.0, 5000, 100, 1000, -3) == 1003  # never past the budget
