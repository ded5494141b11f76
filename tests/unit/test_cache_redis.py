"""The cache's Redis tier without sockets (velox.cache.redis): lookups gathered into one call,
the timeout, a failure marking Redis down, a late reply, ages and max-age, the value format,
against a fake redis.asyncio client. Real processes and a real redis-server are exercised in
tests/cluster/test_cache_redis.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.unit.test_cache import Harness, make_request
from velox.cache import redis as cache_redis
from velox.cache.redis import RedisTier, decode_value, encode_value, redis_key
from velox.cache.store import HEADER, HIT, encode_entry
from velox.core.clock import now_ms
from velox.core.fields import F
from velox.state.stats import SharedStats

ENTRY = encode_entry(False, [(b"content-type", b"application/json")], b'{"answer": 1}')


class FakePipeline:
    def __init__(self, client: FakeClient) -> None:
        self.client = client
        self.ops: list[tuple[Any, ...]] = []

    def set(self, name: bytes, value: bytes, px: int) -> None:
        self.ops.append(("set", name, value, px))

    def mget(self, names: list[bytes]) -> None:
        self.ops.append(("mget", list(names)))

    async def execute(self) -> list[Any]:
        client = self.client
        client.calls.append(self.ops)
        if client.delay:
            await asyncio.sleep(client.delay)
        if client.error is not None:
            raise client.error
        out: list[Any] = []
        for op in self.ops:
            if op[0] == "set":
                client.data[op[1]] = op[2]
                out.append(True)
            else:
                out.append([client.data.get(n) for n in op[1]])
        return out


class FakeClient:
    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.calls: list[list[tuple[Any, ...]]] = []
        self.delay = 0.0
        self.error: BaseException | None = None

    def pipeline(self, transaction: bool = True) -> FakePipeline:
        assert transaction is False
        return FakePipeline(self)

    async def aclose(self) -> None:
        pass


class FakeTier(RedisTier):
    """The tier with the fake client where it would connect."""

    __slots__ = ("fake",)

    def _connect(self) -> Any:
        return self.fake


class Rig:
    def __init__(self, timeout_ms: int = 50) -> None:
        self.h = Harness()
        self.resumed: list[Any] = self.h.alone  # misses go on from the limiter
        self.client = FakeClient()
        self.tier = FakeTier("redis://127.0.0.1:1/0", timeout_ms, 60_000, self.h.loop,
                             self.h.shared.counters, 0)
        self.tier.fake = self.client
        self.h.front.attach_redis(self.tier)

    def run(self, seconds: float) -> None:
        self.h.loop.run_until_complete(asyncio.sleep(seconds))


@pytest.fixture
def rig() -> Any:
    r = Rig()
    yield r
    r.h.close()


def test_value_format() -> None:
    value = encode_value(1234, ENTRY)
    assert decode_value(value) == (1234, ENTRY)
    assert decode_value(b"junk") is None
    assert redis_key(b"\xab" * 32) == b"velox:cache:" + b"ab" * 32


def test_a_redis_hit_is_answered_and_copied_locally(rig: Rig) -> None:
    first, second = make_request(), make_request()
    key = rig.h.front.intent(first).key
    rig.client.data[redis_key(key)] = encode_value(cache_redis.wall_ms() - 3000, ENTRY)
    assert rig.h.front.front([first, second]) == []  # both wait on one lookup
    rig.run(0.01)
    assert len(rig.client.calls) == 1 and rig.client.calls[0] == [("mget", [redis_key(key)])]
    for r in (first, second):
        assert r.conn.header(HEADER) == HIT and int(r.conn.header(b"age")) >= 3
    assert rig.h.count(F.CACHE_REDIS_HITS) == 2 and rig.h.count(F.CACHE_HITS) == 2
    # The local copy keeps the age: a later hit is local, Redis is not asked again.
    third = make_request()
    assert rig.h.front.front([third]) == []
    assert int(third.conn.header(b"age")) >= 3 and len(rig.client.calls) == 1


def test_max_age_and_a_missing_entry_go_on_as_misses(rig: Rig) -> None:
    old = make_request(headers=[(b"cache-control", b"max-age=1")])
    key = rig.h.front.intent(old).key
    rig.client.data[redis_key(key)] = encode_value(cache_redis.wall_ms() - 5000, ENTRY)
    other = make_request(body=b'{"model": "m", "messages": [], "n": 2}')
    assert rig.h.front.front([old, other]) == []
    rig.run(0.01)
    assert rig.resumed == [old, other] and old.exchange is None
    assert rig.h.count(F.CACHE_REDIS_MISSES) == 2 and rig.h.count(F.CACHE_REDIS_HITS) == 0


def test_a_slow_redis_times_out_and_a_late_reply_only_fills_the_local_store(rig: Rig) -> None:
    request = make_request()
    key = rig.h.front.intent(request).key
    rig.client.data[redis_key(key)] = encode_value(cache_redis.wall_ms(), ENTRY)
    rig.client.delay = 0.2
    assert rig.h.front.front([request]) == []
    rig.run(0.1)  # past the 50 ms timeout, before the reply
    assert rig.resumed == [request] and rig.h.count(F.CACHE_REDIS_ERRORS) == 1
    # While the call is out past the timeout, new lookups skip Redis at once.
    assert rig.h.front.front([make_request(body=b'{"model": "m", "x": 1}')]) != []
    rig.run(0.2)
    assert rig.h.store.get(key, now_ms()) is not None
    assert request.conn.header(HEADER) is None  # answered once only: by the miss path


def test_a_failed_call_marks_redis_down_and_drops_writes(rig: Rig) -> None:
    rig.client.error = ConnectionError("refused")
    request = make_request()
    assert rig.h.front.front([request]) == []
    rig.run(0.01)
    assert rig.resumed == [request] and rig.h.count(F.CACHE_REDIS_ERRORS) == 1
    # Down: no call, no wait, writes dropped.
    calls = len(rig.client.calls)
    later = make_request(body=b'{"model": "m", "y": 1}')
    assert rig.h.front.front([later]) == [later]
    rig.h.front.put(b"k" * 32, ENTRY)
    rig.run(0.01)
    assert len(rig.client.calls) == calls
    assert rig.h.count(F.CACHE_REDIS_ERRORS) == 2 and rig.h.count(F.CACHE_REDIS_DROPPED) == 1
    # After RETRY_DOWN_S the next lookup tries again, and a stored answer is written.
    rig.client.error = None
    rig.tier.down_until = 0.0
    rig.h.front.put(b"k" * 32, ENTRY)
    rig.run(0.01)
    name, value = rig.client.calls[-1][0][1:3]
    assert name == redis_key(b"k" * 32) and decode_value(value)[1] == ENTRY  # type: ignore[index]
    assert rig.client.calls[-1][0][3] == 60_000 and rig.h.count(F.CACHE_REDIS_STORES) == 1


def test_a_client_leaving_a_redis_lookup_is_released_and_never_answered(rig: Rig) -> None:
    leaving, staying = make_request(), make_request()
    key = rig.h.front.intent(leaving).key
    rig.client.delay = 0.02
    assert rig.h.front.front([leaving, staying]) == []
    leaving.conn.closed = True  # type: ignore[attr-defined]
    leaving.exchange.client_gone()  # type: ignore[union-attr] # what ingress does
    assert leaving.exchange is None  # dropped; ingress finishes it (its body, its key)
    rig.run(0.05)
    assert rig.resumed == [staying]  # the miss goes on; the one that left does not
    assert leaving.conn.status == 0 and key not in rig.tier.lookups  # type: ignore[attr-defined]
    # Every client leaves: the lookup still ends by itself, and its answer only fills the
    # local store (no one is answered, nothing goes on).
    rig.client.data[redis_key(key)] = encode_value(cache_redis.wall_ms(), ENTRY)
    alone = make_request()
    assert rig.h.front.front([alone]) == []
    alone.conn.closed = True  # type: ignore[attr-defined]
    alone.exchange.client_gone()  # type: ignore[union-attr]
    rig.run(0.05)
    assert rig.resumed == [staying] and alone.conn.status == 0  # type: ignore[attr-defined]
    assert key not in rig.tier.lookups and rig.h.store.get(key, now_ms())


def test_a_call_may_take_as_long_as_a_lookup_may_wait() -> None:
    """The socket timeout is 0.5 s or the lookup timeout, whichever is longer: a Redis slower
    than 0.5 s but within VELOX_CACHE_REDIS_TIMEOUT_MS is used, not marked down on each call."""
    loop = asyncio.new_event_loop()
    try:
        for timeout_ms, expected in ((5, 0.5), (2000, 2.0)):
            tier = RedisTier("redis://127.0.0.1:1/0", timeout_ms, 1000, loop,
                             SharedStats(1).counters, 0)
            options = tier._connect().connection_pool.connection_kwargs
            assert options["socket_timeout"] == options["socket_connect_timeout"] == expected
    finally:
        loop.close()
