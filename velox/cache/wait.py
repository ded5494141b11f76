"""Requests held for one key until an answer comes or they are let go on.

A request that waits (for an identical request in flight, for another worker's leader, for
the Redis tier's answer) is represented by a `Waiting` in place of its exchange
(request.exchange): ingress tells it when its client leaves. `WaitList` is the common part of
the waits that hold requests without an upstream call of their own (velox.cache.front's
cross-worker `RemoteWait`, velox.cache.redis's `RedisLookup`). Both see the cache stage only
through the `Front` protocol below, so this module and the Redis tier sit below the stage.
"""

from __future__ import annotations

import asyncio
from typing import Generic, Protocol, TypeVar

from velox.cache.store import Replay, Store
from velox.core.types import Request
from velox.relay.usage import SSEUsage, client_asked_usage

# How far a streaming follower's client may fall behind the live stream it shares (bytes given
# to it and not yet taken, beyond the events it got on joining) before it is cut off. An LLM
# stream comes at tens of KiB per second: 1 MiB behind is a client that has stopped keeping up.
FOLLOWER_LAG_BYTES = 1 << 20


class Owner(Protocol):
    """Whatever holds a `Waiting` (a recorded call's `Flight`, a `WaitList`)."""

    def leave(self, waiting: Waiting) -> None:
        """The waiting request's client left."""


class Front(Protocol):
    """What the waits and the Redis tier need of the worker's cache stage (CacheFront)."""

    @property
    def store(self) -> Store: ...

    @property
    def ttl_ms(self) -> int: ...

    def decode(self, key: bytes, value: bytes, born_ms: int) -> tuple[Replay, memoryview]:
        """A stored value of `key`, decoded for writing (and kept while it is written)."""

    def answer(self, request: Request, key: bytes, replay: Replay, body: memoryview,
               now: int) -> None:
        """Answer the request from a stored entry."""

    def go_on(self, requests: list[Request]) -> None:
        """Requests a wait could not answer: on to the miss path."""


def usage_filter(request: Request) -> SSEUsage | None:
    """For a streamed answer recorded from another request: the filter that removes the usage
    chunk (and the `"usage":null` members that come with it) when this request's client did
    not ask for usage. The key leaves `stream_options` out, so one entry serves both."""
    if not request.stream or client_asked_usage(request.body):
        return None
    return SSEUsage(True)


class Waiting:
    """A follower's stand-in for an exchange (request.exchange): ingress tells it when the
    client leaves or can take writes again."""

    __slots__ = ("owner", "request", "started", "usage", "lag")

    def __init__(self, owner: Owner, request: Request) -> None:
        self.owner = owner
        self.request = request
        self.started = False  # the answer's head has been written to this client
        # A streamed answer carries the usage chunk the leader's meter asked for (or its
        # client did): removed for a follower whose own request did not ask (velox.relay.usage).
        self.usage = usage_filter(request)
        # Most bytes of a live stream its client may leave untaken (Flight.join sets it).
        self.lag = FOLLOWER_LAG_BYTES

    def send(self, data: bytes) -> bool:
        """Relay a piece of the leader's stream to this follower (its usage chunk removed
        unless it asked for one). False: its client fell too far behind and was cut off."""
        conn = self.request.conn
        if conn.queued > self.lag:
            return False
        usage = self.usage
        if usage is not None:
            data = usage.feed(data)
        if data:
            conn.send_chunk(data)
        return True

    def end_stream(self) -> None:
        usage = self.usage
        if usage is not None:
            rest = usage.flush()
            if rest:
                self.request.conn.send_chunk(rest)
        self.request.conn.end_stream()

    def client_gone(self) -> None:
        self.owner.leave(self)

    def client_writable(self) -> None:
        pass


FrontT = TypeVar("FrontT", bound=Front)


class WaitList(Generic[FrontT]):
    """Requests of this worker held for one key until something answers them or lets them go
    on (the owner of their `Waiting`): cross-worker followers (`RemoteWait`) and Redis lookups
    (velox.cache.redis.RedisLookup). It keeps them, runs one timer (a poll, a timeout), and
    drops a request whose client leaves; `take` ends the wait and hands the rest back."""

    __slots__ = ("front", "key", "requests", "timer")

    def __init__(self, front: FrontT, key: bytes) -> None:
        self.front = front
        self.key = key
        self.requests: list[Waiting] = []
        self.timer: asyncio.TimerHandle | None = None

    def join(self, request: Request) -> None:
        waiting = Waiting(self, request)
        request.exchange = waiting
        self.requests.append(waiting)

    def leave(self, waiting: Waiting) -> None:
        """A waiting client left: its request is dropped and its body freed."""
        try:
            self.requests.remove(waiting)
        except ValueError:
            return
        waiting.request.exchange = None  # its end (Request.finish) gives its body back
        if not self.requests:
            self.emptied()

    def emptied(self) -> None:
        """The last waiting client left (the subclass decides whether the wait goes on)."""

    def closed(self) -> None:
        """The wait ended (the subclass forgets it wherever it is registered)."""

    def take(self) -> list[Request]:
        """End the wait: the timer stops, the wait is forgotten, and the requests still
        waiting are handed back, detached from it."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.closed()
        requests = [w.request for w in self.requests]
        self.requests = []
        for request in requests:
            request.exchange = None
        return requests
