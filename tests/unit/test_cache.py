"""The response cache's logic without sockets: the key's canonical form, Cache-Control, what
counts as storable, the stored entry's encoding, and the coalescing bookkeeping of `Flight`
(followers served, sent alone, never cancelled while someone waits), against a small
pure-Python store with the native SharedCache's API. The real store and real processes are
exercised in tests/e2e/test_cache.py."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

import orjson
import pytest

from velox.cache import front as cache
from velox.cache.front import CacheFront
from velox.cache.store import (
    BYPASS,
    HEADER,
    HIT,
    MISS,
    cache_control,
    cache_key,
    canonical_body,
    complete_event_stream,
    decode_entry,
    enabled,
    encode_entry,
    storable,
)
from velox.cache.wait import FOLLOWER_LAG_BYTES
from velox.config.settings import Settings
from velox.core.clock import now_ms
from velox.core.fields import F
from velox.core.types import Kind, Request
from velox.ingress.connection import WHOLE_BYTES
from velox.relay.exchange import Exchange
from velox.state.stats import SharedStats

from ..ends import Continued


class FakeStore:
    """The SharedCache API in Python, one process only (for these tests); `pid` plays the
    calling process, `dead` the processes that are gone."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.capacity = capacity
        self.max_value = capacity // 4
        self.entries: OrderedDict[bytes, tuple[bytes, int, int]] = OrderedDict()
        self.markers: dict[bytes, list[int]] = {}  # key → [expires_ms, waiters, owner]
        self.pid = 1  # the process calling (markers are owned by a pid, like the native store's)
        self.dead: set[int] = set()  # pids of processes that are gone

    def get(self, key: bytes, now_ms: int, max_age_ms: int = -1) -> tuple[bytes, int] | None:
        got = self.entries.get(key)
        if got is None:
            return None
        value, created, expires = got
        if now_ms >= expires:
            del self.entries[key]
            return None
        if max_age_ms >= 0 and now_ms - created > max_age_ms:
            return None
        self.entries.move_to_end(key)
        return value, now_ms - created

    def put(self, key: bytes, value: bytes, now_ms: int, ttl_ms: int) -> bool:
        if len(value) > self.max_value:
            return False
        self.entries[key] = (value, now_ms, now_ms + ttl_ms)
        self.entries.move_to_end(key)
        while sum(len(v[0]) for v in self.entries.values()) > self.capacity:
            self.entries.popitem(last=False)
        return True

    def claim(self, key: bytes, now_ms: int, hold_ms: int) -> bool:
        marker = self.markers.get(key)
        if marker is not None and self._live(marker, now_ms):
            marker[1] += 1
            return False
        self.markers[key] = [now_ms + hold_ms, marker[1] if marker else 0, self.pid]
        return True

    def renew(self, key: bytes, now_ms: int, hold_ms: int) -> bool:
        marker = self.markers.get(key)
        if marker is None or marker[2] != self.pid:
            return False
        marker[0] = now_ms + hold_ms
        return True

    def unwait(self, key: bytes) -> None:
        if key in self.markers:
            self.markers[key][1] -= 1

    def waiting(self, key: bytes) -> int:
        return self.markers[key][1] if key in self.markers else 0

    def release(self, key: bytes) -> None:
        marker = self.markers.get(key)
        if marker is not None and marker[2] == self.pid:
            del self.markers[key]

    def pending(self, key: bytes, now_ms: int) -> bool:
        marker = self.markers.get(key)
        return marker is not None and self._live(marker, now_ms)

    def _live(self, marker: list[int], now_ms: int) -> bool:
        return marker[0] > now_ms and marker[2] not in self.dead

    def stats(self) -> dict[str, int]:
        return {"entries": len(self.entries), "bytes": 0, "capacity": self.capacity,
                "evictions": 0, "expired": 0, "max_value": self.max_value, "markers": 0}


# --- the key ------------------------------------------------------------------------------------


def test_canonical_body_sorts_keys_drops_whitespace_and_ignored_members() -> None:
    a = b'{ "model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5,\n'\
        b'  "user": "alice", "metadata": {"x": "1"}, "stream_options": {"include_usage": true} }'
    b = b'{"temperature":0.5,"messages":[{"content":"hi","role":"user"}],"model":"m","user":"bob"}'
    assert canonical_body(a) == canonical_body(b)
    assert canonical_body(a) == (b'{"messages":[{"content":"hi","role":"user"}],"model":"m",'
                                 b'"temperature":0.5}')
    # What changes the answer changes the form.
    assert canonical_body(b'{"model":"m","temperature":0.6}') != \
        canonical_body(b'{"model":"m","temperature":0.5}')
    assert canonical_body(memoryview(b'{"model":"m"}')) == b'{"model":"m"}'
    assert canonical_body(b"[1, 2]") is None
    assert canonical_body(b"{not json") is None


def test_key_depends_on_every_part() -> None:
    base = ("/v1/chat/completions", "gpt-4o", b"\x01" * 32, False, b'{"model":"gpt-4o"}')
    key = cache_key(base[0].encode(), *base[1:])  # type: ignore[arg-type]
    assert len(key) == 32
    variants = [
        (b"/v1/completions", *base[1:]),
        (base[0].encode(), "gpt-4o-mini", *base[2:]),
        (base[0].encode(), base[1], b"\x02" * 32, *base[3:]),
        (base[0].encode(), base[1], b"", *base[3:]),
        (base[0].encode(), base[1], base[2], True, base[4]),
        (base[0].encode(), *base[1:4], b'{"model":"gpt-4o","n":2}'),
    ]
    keys = {cache_key(*v) for v in variants}  # type: ignore[arg-type]
    assert key not in keys and len(keys) == len(variants)
    # Length prefixes: moving bytes from one part to the next gives another key.
    assert cache_key(b"/a", "bc", b"", False, b"{}") != cache_key(b"/ab", "c", b"", False, b"{}")


@pytest.mark.parametrize("value, expected", [
    (b"no-cache", (True, False, -1)),
    (b"no-store", (False, True, -1)),
    (b"max-age=30", (False, False, 30_000)),
    (b"Max-Age=0", (False, False, 0)),
    (b'max-age="5"', (False, False, 5_000)),
    (b"no-cache, max-age=10", (True, False, 10_000)),
    (b"max-age=abc", (False, False, 0)),  # unreadable: only a fresh answer will do
    (b"max-age=-3", (False, False, 0)),
    (b"max-age=99999999999", (False, False, (1 << 31) * 1000)),
    (b"private, stale-while-revalidate=5", (False, False, -1)),
    (b"", (False, False, -1)),
])
def test_cache_control(value: bytes, expected: tuple[bool, bool, int]) -> None:
    assert cache_control([(b"cache-control", value)]) == expected


def test_cache_control_combines_headers_and_ignores_others() -> None:
    headers = [(b"pragma", b"no-cache"), (b"cache-control", b"max-age=60"),
               (b"cache-control", b"no-store, max-age=20")]
    assert cache_control(headers) == (False, True, 20_000)


# --- what is stored -----------------------------------------------------------------------------

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
EVENTS = (b'data: {"id":"1","choices":[{"delta":{"content":"Hi"}}]}\n\n'
          b'data: {"id":"1","choices":[{"delta":{},"finish_reason":"stop"}]}\n\n'
          b"data: [DONE]\n\n")


def test_storable_only_complete_200s_whose_body_matches_the_content_type() -> None:
    assert storable(200, JSON, b'{"ok": true}')
    assert not storable(200, JSON, b'{"ok": tr')  # truncated JSON
    assert not storable(500, JSON, b'{"error": {}}')
    assert not storable(429, JSON, b'{"ok": true}')
    assert not storable(200, [(b"content-type", b"text/plain")], b"hello")
    assert not storable(200, [], b"{}")
    assert storable(200, SSE, EVENTS)
    assert storable(200, SSE, EVENTS.replace(b"\n", b"\r\n"))
    assert not storable(200, SSE, EVENTS[:-len(b"data: [DONE]\n\n")])  # no [DONE]
    assert not storable(200, SSE, EVENTS[:30])  # cut inside an event
    with_error = (b'data: {"id":"1"}\n\n' b'data: {"error": {"message": "overloaded"}}\n\n'
                  b"data: [DONE]\n\n")
    assert not storable(200, SSE, with_error)
    assert not storable(200, SSE, b"event: error\ndata: {}\n\ndata: [DONE]\n\n")
    # The word "error" inside a delta is content, not an error event.
    assert complete_event_stream(b'data: {"choices":[{"delta":{"content":"\\"error\\""}}]}\n\n'
                                 b"data: [DONE]\n\n")


def test_entry_round_trip() -> None:
    headers = [(b"content-type", b"text/event-stream"), (b"x-request-id", b"req_1")]
    assert decode_entry(encode_entry(True, headers, EVENTS)) == (True, headers, EVENTS)
    assert decode_entry(encode_entry(False, [], b"{}")) == (False, [], b"{}")


# --- the stage: hits, followers, failures (no sockets) -------------------------------------------


class FakeConn:
    """A client connection that records what it is sent (velox.core.types.Responder)."""

    def __init__(self) -> None:
        self.closed = False
        self.write_paused = False
        self.queued = 0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.ended = False
        self.aborted = False

    def respond(self, request: Request, status: int, headers: Any, body: Any) -> None:
        self.status, self.headers, self.body, self.ended = status, list(headers), bytes(body), True

    def respond_error(self, request: Request, exc: BaseException) -> None:
        self.status, self.ended = getattr(exc, "status", 500), True

    def start_stream(self, request: Request, status: int, headers: Any) -> None:
        self.status, self.headers = status, list(headers)

    def send_chunk(self, data: bytes) -> None:
        self.body += data

    def end_stream(self) -> None:
        self.ended = True

    def abort(self) -> None:
        self.aborted = True

    def header(self, name: bytes) -> bytes | None:
        return dict(self.headers).get(name)


class FakeAttempt:
    t_sent = 1
    t_headers = 2

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def resume(self) -> None:
        pass


BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def make_request(body: bytes = BODY, headers: list[tuple[bytes, bytes]] | None = None,
                 stream: bool = False) -> Request:
    request = Request(FakeConn(), b"POST", b"/v1/chat/completions", Kind.MODEL_CALL,
                      [(b"authorization", b"Bearer k1")] + (headers or []), body, True, 0)
    request.model = "m"
    request.stream = stream
    return request


class Harness:
    """A CacheFront with a fake store; `send_alone` and dispatch are recorded, not sent."""

    def __init__(self, **settings: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.store = FakeStore()
        self.shared = SharedStats(1)
        self.continued = Continued()
        self.alone: list[Request] = self.continued.requests  # on from the limiter
        self.front = CacheFront(Settings(cache=True, **settings), Settings().tables,  # type: ignore[arg-type]
                                self.store, self.loop, self.shared.counters,
                                self.shared.histograms, 0, self.continued)

    def close(self) -> None:
        self.loop.close()

    def count(self, field: F) -> int:
        return self.shared.counters.totals()[field]

    def lead(self, request: Request) -> Exchange:
        """What the worker does with an admitted miss: an exchange with its observer."""
        assert not self.front.follows(request)
        exchange = Exchange(request, request.path, [], lambda e, s: None)
        self.front.observe(exchange)
        exchange.attempt = FakeAttempt()  # type: ignore[assignment]
        return exchange


@pytest.fixture
def harness() -> Any:
    h = Harness()
    yield h
    h.close()


def answer(exchange: Exchange, status: int = 200, body: bytes = b'{"answer": 1}',
           headers: list[tuple[bytes, bytes]] | None = None) -> None:
    exchange.on_response(status, headers or list(JSON), False)
    exchange.on_data(body, True)


def test_miss_then_hit_with_the_same_body(harness: Harness) -> None:
    first = make_request()
    assert harness.front.front([first]) == [first]
    exchange = harness.lead(first)
    answer(exchange)
    assert first.conn.header(HEADER) == MISS  # type: ignore[attr-defined]
    second = make_request(body=b'{"messages":[{"content":"hi","role":"user"}], "model":"m"}')
    assert harness.front.front([second]) == []  # answered from the cache
    conn = second.conn
    assert conn.status == 200 and conn.body == b'{"answer": 1}'  # type: ignore[attr-defined]
    assert conn.header(HEADER) == HIT and conn.header(b"age") == b"0"  # type: ignore[attr-defined]
    assert harness.count(F.CACHE_HITS) == 1 and harness.count(F.CACHE_MISSES) == 1


def test_other_caller_no_store_no_cache(harness: Harness) -> None:
    answer(harness.lead(harness.front.front([make_request()])[0]))
    other = make_request()
    other.headers = [(b"authorization", b"Bearer k2")]
    assert harness.front.front([other]) == [other]  # another tenant: a miss
    no_store = make_request(headers=[(b"cache-control", b"no-store")])
    assert harness.front.front([no_store]) == [no_store]
    exchange = harness.lead(no_store)
    answer(exchange, body=b'{"answer": 2}')
    assert no_store.conn.header(HEADER) == BYPASS  # type: ignore[attr-defined]
    no_cache = make_request(headers=[(b"cache-control", b"no-cache")])
    assert harness.front.front([no_cache]) == [no_cache]  # skips the lookup ...
    answer(harness.lead(no_cache), body=b'{"answer": 3}')
    again = make_request()
    harness.front.front([again])
    assert again.conn.body == b'{"answer": 3}'  # type: ignore[attr-defined] # ... stores the fresh one


def test_followers_in_the_same_batch_and_later_get_the_leaders_answer(harness: Harness) -> None:
    requests = [make_request() for _ in range(3)]
    going = harness.front.front(requests)
    assert going == requests  # nothing is in flight yet: all three go on to the limiter
    exchange = harness.lead(going[0])
    assert harness.front.follows(going[1]) and harness.front.follows(going[2])
    late = make_request()
    assert harness.front.front([late]) == []  # follows too
    answer(exchange)
    for request in [*requests[1:], late]:
        assert request.conn.body == b'{"answer": 1}'  # type: ignore[attr-defined]
        assert request.conn.header(HEADER) == HIT  # type: ignore[attr-defined]
        assert request.exchange is None
    assert harness.count(F.CACHE_COALESCED) == 3 and harness.count(F.CACHE_MISSES) == 1
    assert not harness.front.flights and not harness.store.markers  # marker released


def test_followers_of_a_failed_leader_are_sent_alone(harness: Harness) -> None:
    leader, follower = make_request(), make_request()
    exchange = harness.lead(harness.front.front([leader])[0])
    assert harness.front.front([follower]) == []
    answer(exchange, status=503, body=b'{"error": {}}')
    assert leader.conn.status == 503  # type: ignore[attr-defined]
    assert harness.alone == [follower] and follower.cache.alone and not follower.cache.follow
    assert harness.count(F.CACHE_ALONE) == 1 and not harness.store.entries
    # Sent alone, it records and stores, but leads no one.
    exchange = harness.lead(follower)
    assert not harness.front.flights
    answer(exchange)
    assert len(harness.store.entries) == 1


def test_leader_error_before_headers_sends_followers_alone(harness: Harness) -> None:
    leader, follower = make_request(), make_request()
    exchange = harness.lead(harness.front.front([leader])[0])
    harness.front.front([follower])
    exchange.on_error(ConnectionResetError())
    assert harness.alone == [follower]


def test_leader_client_leaving_does_not_cancel_while_others_wait(harness: Harness) -> None:
    leader, follower = make_request(), make_request()
    exchange = harness.lead(harness.front.front([leader])[0])
    attempt = exchange.attempt
    harness.front.front([follower])
    leader.conn.closed = True  # type: ignore[attr-defined]
    exchange.client_gone()
    assert not attempt.cancelled and not exchange.finished  # type: ignore[union-attr]
    answer(exchange)
    assert follower.conn.body == b'{"answer": 1}'  # type: ignore[attr-defined]
    assert len(harness.store.entries) == 1


def test_upstream_call_cancelled_once_no_one_is_left(harness: Harness) -> None:
    leader, follower = make_request(), make_request()
    exchange = harness.lead(harness.front.front([leader])[0])
    attempt = exchange.attempt
    harness.front.front([follower])
    exchange.client_gone()
    assert not attempt.cancelled  # type: ignore[union-attr]
    follower.exchange.client_gone()  # type: ignore[union-attr]
    assert attempt.cancelled and exchange.finished  # type: ignore[union-attr]
    # Dropped from the flight; its end (Request.finish: body, key) is ingress's, when the
    # connection is lost (tests/unit/test_ingress.py).
    assert follower.exchange is None
    assert not harness.front.flights and not harness.store.markers


def test_remote_waiters_keep_the_call_running(harness: Harness) -> None:
    leader = make_request()
    exchange = harness.lead(harness.front.front([leader])[0])
    key = leader.cache.key
    assert not harness.store.claim(key, now_ms(), 1000)  # a waiter in another worker
    exchange.client_gone()
    assert not exchange.attempt.cancelled  # type: ignore[union-attr]
    harness.store.unwait(key)


def _run(harness: Harness, seconds: float) -> None:
    harness.loop.run_until_complete(asyncio.sleep(seconds))


def test_a_remote_waiter_goes_alone_as_soon_as_its_leaders_process_is_gone(
        harness: Harness) -> None:
    key = harness.front.intent(make_request()).key
    harness.store.pid = 2  # another worker leads, with a lease far longer than this test
    assert harness.store.claim(key, now_ms(), 3_600_000)
    harness.store.pid = 1
    follower = make_request()
    assert harness.front.front([follower]) == []  # waits for the other worker's answer
    _run(harness, 0.05)
    assert harness.alone == [] and harness.front.state()["remote_waits"] == 1
    harness.store.dead.add(2)  # the leader's worker is SIGKILLed (and reaped)
    _run(harness, 0.05)  # a poll or two (20 ms apart at most)
    assert harness.alone == [follower] and follower.cache.alone
    assert harness.front.state()["remote_waits"] == 0 and harness.count(F.CACHE_ALONE) == 1


def test_a_remote_waiter_whose_client_leaves_is_released_and_the_wait_ends(
        harness: Harness) -> None:
    key = harness.front.intent(make_request()).key
    harness.store.pid = 2
    assert harness.store.claim(key, now_ms(), 3_600_000)
    harness.store.pid = 1
    first, second = make_request(), make_request()
    assert harness.front.front([first, second]) == []
    assert harness.store.waiting(key) == 1 and harness.front.state()["remote_waits"] == 2
    first.exchange.client_gone()  # type: ignore[union-attr]
    assert first.exchange is None
    assert harness.front.state()["remote_waits"] == 1 and key in harness.front.waits
    second.exchange.client_gone()  # type: ignore[union-attr] # the last one: the wait ends
    assert second.exchange is None and key not in harness.front.waits
    assert harness.store.waiting(key) == 0  # no longer counted on the other's marker
    _run(harness, 0.05)
    assert harness.alone == []
    assert first.conn.status == second.conn.status == 0  # type: ignore[attr-defined]


def test_a_leader_renews_its_lease_and_forgets_a_marker_taken_over(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "RENEW_S", 0.01)
    leader = make_request()
    exchange = harness.lead(harness.front.front([leader])[0])
    key = leader.cache.key
    flight = exchange.observer
    first = harness.store.markers[key][0]
    _run(harness, 0.05)
    assert harness.store.markers[key][0] > first  # renewed while the call runs
    assert harness.front.renewing is not None and key in harness.front.held
    # The lease lapsed (a stalled loop) and another worker took the key over: this flight
    # no longer leads across workers, stops renewing, and leaves the other's marker alone.
    harness.store.markers[key][2] = 2
    _run(harness, 0.05)
    assert not flight.marker and not harness.front.held  # type: ignore[union-attr]
    assert harness.front.renewing is None
    answer(exchange)
    assert harness.store.markers[key][2] == 2 and len(harness.store.entries) == 1
    # A leader that ends drops its own marker and the renewals stop.
    other = make_request(body=b'{"model":"m","messages":[]}')
    exchange = harness.lead(harness.front.front([other])[0])
    assert harness.front.renewing is not None
    answer(exchange)
    assert other.cache.key not in harness.store.markers and not harness.front.held
    _run(harness, 0.03)
    assert harness.front.renewing is None


def test_streaming_follower_gets_events_so_far_then_the_rest_live(harness: Harness) -> None:
    leader = make_request(stream=True)
    exchange = harness.lead(harness.front.front([leader])[0])
    exchange.on_response(200, list(SSE), False)
    first, rest = EVENTS[:60], EVENTS[60:]
    exchange.on_data(first, False)
    follower = make_request(stream=True)
    assert harness.front.front([follower]) == []
    # The whole events so far (a follower's usage filter holds an unfinished event back).
    so_far = first[:first.rindex(b"\n\n") + 2]
    assert follower.conn.status == 200 and follower.conn.body == so_far  # type: ignore[attr-defined]
    exchange.on_data(rest, True)
    assert follower.conn.body == EVENTS and follower.conn.ended  # type: ignore[attr-defined]
    assert leader.conn.body == EVENTS  # type: ignore[attr-defined]
    hit = make_request(stream=True)
    harness.front.front([hit])
    assert hit.conn.body == EVENTS and hit.conn.header(HEADER) == HIT  # type: ignore[attr-defined]


USAGE_EVENTS = (b'data: {"id":"1","choices":[{"delta":{"content":"Hi"}}],"usage":null}\n\n'
                b'data: {"id":"1","choices":[],"usage":{"prompt_tokens":5,'
                b'"completion_tokens":1,"total_tokens":6}}\n\n'
                b"data: [DONE]\n\n")


def test_replay_and_followers_drop_the_usage_chunk_only_for_clients_that_did_not_ask(
        harness: Harness) -> None:
    """The key leaves stream_options out: an answer recorded with the usage chunk (the
    gateway asks for it to count tokens) is replayed without it to a client that did not ask,
    with it to one that did, as the upstream would have answered each."""
    asked = BODY[:-1] + b',"stream":true,"stream_options":{"include_usage":true}}'
    plain = BODY[:-1] + b',"stream":true}'
    leader = make_request(body=plain, stream=True)
    exchange = harness.lead(harness.front.front([leader])[0])
    exchange.on_response(200, list(SSE), False)
    exchange.on_data(USAGE_EVENTS[:40], False)
    follower = make_request(body=plain, stream=True)
    asking = make_request(body=asked, stream=True)
    assert harness.front.front([follower, asking]) == []
    exchange.on_data(USAGE_EVENTS[40:], True)
    without = (b'data: {"id":"1","choices":[{"delta":{"content":"Hi"}}]}\n\n'
               b"data: [DONE]\n\n")
    assert follower.conn.body == without  # type: ignore[attr-defined]
    assert asking.conn.body == USAGE_EVENTS  # type: ignore[attr-defined]
    hit, hit_asking = make_request(body=plain, stream=True), make_request(body=asked, stream=True)
    harness.front.front([hit, hit_asking])
    assert hit.conn.body == without and hit.conn.header(HEADER) == HIT  # type: ignore[attr-defined]
    assert hit_asking.conn.body == USAGE_EVENTS  # type: ignore[attr-defined]


def test_broken_stream_is_not_stored_and_followers_see_it_break(harness: Harness) -> None:
    leader = make_request(stream=True)
    exchange = harness.lead(harness.front.front([leader])[0])
    exchange.on_response(200, list(SSE), False)
    exchange.on_data(EVENTS[:EVENTS.index(b"\n\n") + 2], False)
    follower = make_request(stream=True)
    harness.front.front([follower])
    exchange.on_error(ConnectionResetError("reset"))
    assert follower.conn.ended and b'"error"' in follower.conn.body  # type: ignore[attr-defined]
    assert not harness.store.entries and harness.alone == []


class HoldingConn(FakeConn):
    """Keeps the body it was given, as ingress's send queue does until the client took it."""

    def respond(self, request: Request, status: int, headers: Any, body: Any) -> None:
        super().respond(request, status, headers, body)
        self.held = body


def test_hits_of_a_large_answer_share_one_copy_while_it_is_being_written(
        harness: Harness) -> None:
    import gc

    large = orjson.dumps({"data": ["x" * 1000] * 100})  # ~100 KiB: written from itself
    assert len(large) > WHOLE_BYTES
    answer(harness.lead(harness.front.front([make_request()])[0]), body=large)
    hits = [make_request() for _ in range(3)]
    for request in hits:
        request.conn = HoldingConn()
    harness.front.front(hits[:2])
    first, second = hits[0].conn.held, hits[1].conn.held  # type: ignore[attr-defined]
    assert bytes(first) == large and second is first  # one copy for both clients
    # Both clients took their answer: the copy is let go, and the next hit reads the store.
    hits[0].conn.held = hits[1].conn.held = None  # type: ignore[attr-defined]
    del first, second
    gc.collect()
    assert not harness.front.replays
    harness.front.front(hits[2:])
    assert bytes(hits[2].conn.held) == large  # type: ignore[attr-defined]
    # A client asking for a fresher answer than the copy being written reads the store.
    # (max-age 60 s and a copy made 120 s old: the store's entry, written moments ago, is fresh
    # enough however slowly a loaded machine runs this test; with max-age=1 it was not.)
    strict = make_request(headers=[(b"cache-control", b"max-age=60")])
    strict.conn = HoldingConn()
    harness.front.replays[hits[2].cache.key].born_ms -= 120_000
    harness.front.front([strict])
    assert strict.conn.held is not hits[2].conn.held  # type: ignore[attr-defined]
    assert bytes(strict.conn.held) == large  # type: ignore[attr-defined]
    assert harness.count(F.CACHE_HITS) == 4


def test_a_streaming_follower_that_falls_behind_is_cut_off(harness: Harness) -> None:
    leader = make_request(stream=True)
    exchange = harness.lead(harness.front.front([leader])[0])
    exchange.on_response(200, list(SSE), False)
    event = b'data: {"id":"1","choices":[{"delta":{"content":"%b"}}]}\n\n' % (b"y" * 4000)
    exchange.on_data(event * 10, False)
    slow, keeping_up = make_request(stream=True), make_request(stream=True)
    assert harness.front.front([slow, keeping_up]) == []
    joined = len(slow.conn.body)  # type: ignore[attr-defined]
    assert joined == len(event) * 10
    # The slow client takes nothing: what it was given stays queued (ingress's send queue).
    slow.conn.queued = joined  # type: ignore[attr-defined]
    sent = 0
    while sent <= FOLLOWER_LAG_BYTES:
        exchange.on_data(event, False)
        sent += len(event)
        slow.conn.queued = joined + sent  # type: ignore[attr-defined]
        assert not slow.conn.aborted  # type: ignore[attr-defined]
    exchange.on_data(event, False)  # now more than FOLLOWER_LAG_BYTES behind
    assert slow.conn.aborted and slow.exchange is None  # type: ignore[attr-defined]
    assert harness.count(F.CACHE_FOLLOWERS_CUT) == 1
    exchange.on_data(b"data: [DONE]\n\n", True)
    kept: Any = keeping_up.conn
    assert kept.ended and kept.body.endswith(b"[DONE]\n\n") and kept.body == leader.conn.body
    assert not slow.conn.ended  # type: ignore[attr-defined]


# --- configuration ------------------------------------------------------------------------------


def test_route_cache_flag_in_the_file(tmp_path: Any) -> None:
    from velox.config.tables import TableError, UpstreamSpec, load_file

    template = UpstreamSpec("default", "https://api.openai.com")
    path = tmp_path / "velox.toml"
    path.write_text('[[route]]\nmodel = "a"\ntargets = [{ upstream = "default" }]\ncache = true\n'
                    '[[route]]\nmodel = "b"\ntargets = [{ upstream = "default" }]\n')
    tables = load_file(path, {}, template)
    assert [r.cache for r in tables.routes] == [True, False]
    path.write_text('[[route]]\nmodel = "a"\ntargets = [{ upstream = "default" }]\ncache = "yes"\n')
    with pytest.raises(TableError, match=r'velox.toml: \[\[route\]\] #1 \(model "a"\): cache: '
                                         r"must be true or false, got the string \"yes\""):
        load_file(path, {}, template)


def test_settings_and_which_models_are_cached(tmp_path: Any) -> None:
    from velox.config.settings import ConfigError, load

    assert load({}, dotenv=None).cache is False
    settings = load({"VELOX_CACHE": "1", "VELOX_CACHE_MAX_BYTES": "1048576",
                     "VELOX_CACHE_TTL_S": "5"}, dotenv=None)
    assert (settings.cache, settings.cache_max_bytes, settings.cache_ttl_s) == (True, 1 << 20, 5)
    with pytest.raises(ConfigError, match="VELOX_CACHE_MAX_BYTES='1000' is invalid"):
        load({"VELOX_CACHE_MAX_BYTES": "1000"}, dotenv=None)
    assert not enabled(load({}, dotenv=None))
    path = tmp_path / "velox.toml"
    path.write_text('[[route]]\nmodel = "a"\ntargets = [{ upstream = "default" }]\ncache = true\n'
                    '[[route]]\nmodel = "*"\ntargets = [{ upstream = "default" }]\n')
    settings = load({"VELOX_CONFIG": str(path)}, dotenv=None)
    assert enabled(settings)
    loop = asyncio.new_event_loop()
    shared = SharedStats(1)
    front = CacheFront(settings, settings.tables, FakeStore(), loop,  # type: ignore[arg-type]
                       shared.counters, shared.histograms, 0, Continued())
    assert front.cached("a") and not front.cached("b") and not front.cached("*")
    loop.close()
