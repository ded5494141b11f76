"""The values that travel between the stages of a worker, and the interfaces that join them.

A `Request` is built by ingress when a complete HTTP/1.1 request has arrived, travels through
the ring to the worker, and carries its own reply handle (`Responder`, implemented by the
client connection) so that no stage downstream of ingress ever imports ingress. Egress reports
what the upstream does through an `egress.interfaces.Client` (implemented by the relay), so
egress never imports the relay either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any, Protocol

Headers = list[tuple[bytes, bytes]]


class Kind(IntEnum):
    """What a request path is, as far as the gateway cares (decided by ingress.classify)."""

    MODEL_CALL = 1  # chat/completions, completions, embeddings, responses: JSON with a model
    # images, audio, moderations: the model read (JSON, or a multipart form's field; it may
    # be absent: the catch-all route) and checked; tokens only as their answers report them
    MODEL_OTHER = 2
    FORWARD = 3  # any other /v1/... path: forwarded without reading a model
    ROOT = 4  # POST /: the raw producer interface, sent to VELOX_UPSTREAM_REQUEST_PATH
    HEALTH = 5  # GET /healthz
    READY = 6  # GET /readyz


class Responder(Protocol):
    """The client side of one request: how the stages answer it."""

    closed: bool
    write_paused: bool  # the client is not reading: its transport paused our writes

    @property
    def queued(self) -> int:
        """Bytes of answer waiting for the client to take them (ingress's send queue)."""

    def respond(self, request: Request, status: int, headers: Sequence[tuple[bytes, bytes]],
                body: bytes | memoryview) -> None:
        """Send a complete response (status line, headers, content-length, body); a large body
        is written from itself as the client takes it (kept referenced until then)."""

    def respond_error(self, request: Request, exc: BaseException) -> None:
        """Send the OpenAI-shaped error for `exc` (see errors.to_response)."""

    def start_stream(self, request: Request, status: int,
                     headers: Sequence[tuple[bytes, bytes]]) -> None:
        """Send the response head of a streamed (chunked) response."""

    def send_chunk(self, data: bytes) -> None:
        """Send one chunk of a streamed response (written at the end of this loop pass, or
        queued, referenced, while the client is not taking writes)."""

    def end_stream(self) -> None:
        """Terminate the streamed response (last chunk); the connection may serve the next
        request."""

    def abort(self) -> None:
        """The response cannot be completed: close the connection so the client sees the failure."""


# --- the request's lifecycle ---------------------------------------------------------------------
# States as plain ints (a slot compare, not an Enum lookup: ~0.25 us each on Python 3.11) and the
# transition table as one bitmask per state. Every request ends in DONE exactly once, through
# Request.finish, whichever way it ends; an illegal move raises LifecycleError (a bug).
QUEUED = 0  # built by ingress: in the ring, or waiting behind a pipelined answer
PARSED = 1  # past the parse stage (a body scanned off the loop comes back PARSED)
ADMITTED = 2  # past the keys, the cache's front and the limiter: on its way upstream
# Taken by the embeddings batcher (velox.batching.batch): waiting in its group, or carried by
# a merged call that answers it its part; a merged call's own request is BATCHED too.
BATCHED = 3
SENT = 4  # handed on: an exchange, or an identical request's call answers it
ANSWERING = 5  # the client has the head of a streamed answer: only the end is left
DONE = 6  # finished: everything it held is released, its counters and log line written
STATE_NAMES = ("QUEUED", "PARSED", "ADMITTED", "BATCHED", "SENT", "ANSWERING", "DONE")
# Where each state may go (DONE: from anywhere but DONE, so it is not listed per state).
TRANSITIONS: dict[int, tuple[int, ...]] = {
    QUEUED: (PARSED,),
    PARSED: (ADMITTED, ANSWERING),  # a cache hit or the Redis tier answers a parsed request
    ADMITTED: (SENT, BATCHED),
    # A batch member leaves alone through the stage list's "send" (a batch of one, or a merged
    # call's 400 sent again per member); a member answered its part goes to DONE.
    BATCHED: (SENT,),
    # A follower whose leader failed is admitted again and sent alone (velox.cache.front).
    SENT: (ADMITTED, ANSWERING),
    ANSWERING: (),
    DONE: (),
}
# The table as ints: ENTERABLE[to] has bit s set when s -> to is allowed, so the hot path
# checks a move with a shift and a mask in line (`advance`, a method call, costs ~0.1-0.2 us
# more, three times a request).
ENTERABLE = tuple(sum(1 << s for s in TRANSITIONS if to in TRANSITIONS[s])
                  for to in range(len(STATE_NAMES)))


class LifecycleError(RuntimeError):
    """A request moved where its lifecycle does not go (finished twice, sent after its end):
    a bug in the stage that moved it."""


class Holder(Protocol):
    """What holds a request past the worker (the relay's exchange, a cache wait, a batch
    member): ingress tells it when the client leaves or can take writes again."""

    def client_gone(self) -> None: ...

    def client_writable(self) -> None: ...


class KeyTicket(Protocol):
    """What a keyed request's admission holds (native `Limits.ticket`, made by
    velox.admission.keys): its place of the key's gauge, given back once by `release()`, and its
    token reservation, corrected once by `settle(used)` (tokens not used go back, over-use is
    charged as debt; a key without tpm has no token bucket: settled from the start). Native
    because every keyed request makes and ends one: a Python class cost ~1 us more a request."""

    @property
    def released(self) -> bool: ...

    @property
    def reserved(self) -> int: ...

    @property
    def key(self) -> Any:  # the key it was admitted for (velox.admission.keys._Key: `used`)
        ...

    def release(self) -> None: ...

    def settle(self, used: int, /) -> None: ...


class CacheIntent(Protocol):
    """A cached route's model call on its way (velox.cache.front.Intent, set by the cache
    stage as `Request.cache`)."""

    key: bytes  # b"" for a bypass
    follow: bool  # may look up, lead or follow an identical request in flight
    store: bool  # its answer may be stored
    max_age_ms: int  # Cache-Control max-age; -1: any fresh entry
    alone: bool  # sent on its own after its leader failed
    marker: bool  # took the store's in-flight marker: it leads across workers


class Lifecycle(Protocol):
    """The worker's side of a request's end (velox.pipeline.worker.Worker)."""

    def release_segment(self, segment: int) -> None:
        """Give an arena segment back."""

    def finished(self, request: Request, status: int, bytes_out: int,
                 holder: Holder | None) -> None:
        """The request is over: give back what it holds, count it, log it."""


class Pipeline(Protocol):
    """The worker's stages (velox.pipeline.worker): a stage that held requests (the cache's
    waits, the Redis tier) continues them through here from a named stage."""

    def run(self, requests: list[Request], from_stage: str) -> None: ...


class Request:
    """One client request, from ingress to the end of its response, with its lifecycle: its
    `state` moves through TRANSITIONS by `advance`, and `finish` ends it exactly once."""

    __slots__ = (
        "state", "ends",
        "conn", "method", "path", "kind", "headers", "body", "keep_alive", "http10",
        "t_received", "t_popped", "t_parsed", "t_admitted",
        "model", "stream", "upstream_path", "exchange", "arena_segment", "affinity",
        "caller",  # auth.caller_of: digest of the presented credential, computed once
        "cache",  # cache: the request's velox.cache.front.Intent on a cached route, else None
        # keys stage (velox.admission.keys): the caller's [[key]] index (-1: none), what its
        # admission holds (a KeyTicket, released once when the request ends), and response headers
        # every answer to it carries (x-ratelimit-*: ingress appends them to the head)
        "key", "ticket", "extra_headers",
        # the routes the caller's key may use (its `models`; None: any): dispatch takes no
        # fallback outside them
        "allowed",
        # a multipart form's model value, [start, end) in body (parse.form_model), for the
        # route's model rewrite; None for JSON bodies
        "model_span",
        # the headers sent upstream apart from any credential, and the client's credential to
        # pass on (auth.Auth.client_headers' pair), when ingress's native parser made them
        # while parsing the head; None: the worker makes them
        "upstream_headers",
        # the client's traceparent field (W3C Trace Context) as ingress found it while reading
        # the head: None when absent, b"" when sent more than once (then a new trace starts);
        # a tracing worker reads it here instead of looking through the fields per request
        "traceparent",
    )

    def __init__(
        self,
        conn: Responder,
        method: bytes,
        path: bytes,
        kind: Kind,
        headers: Headers,
        body: bytes | bytearray | memoryview,
        keep_alive: bool,
        t_received: int,
        arena_segment: int = -1,
        ends: Lifecycle | None = None,
    ) -> None:
        self.state = QUEUED
        self.ends = ends  # None: a request of the gateway's own (a merged batch call), or a test
        self.conn = conn
        self.method = method
        self.path = path
        self.kind = kind
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        # Its own HTTP version (ingress): a stream is chunked unless its request was HTTP/1.0,
        # whatever the requests pipelined behind it are.
        self.http10 = False
        self.t_received = t_received  # perf_counter_ns() when the last byte arrived
        self.t_popped = 0
        self.t_parsed = 0
        self.t_admitted = 0
        self.model: str | None = None
        self.stream = False
        self.upstream_path = path
        self.affinity: str | None = None  # the body's prompt_cache_key, else its user
        self.exchange: Holder | None = None
        self.arena_segment = arena_segment  # arena segment holding the body, -1 if none
        self.caller: bytes | None = None  # None until auth.caller_of computes it
        self.cache: CacheIntent | None = None  # set by the cache stage
        self.key = -1
        self.ticket: KeyTicket | None = None
        self.extra_headers: list[tuple[bytes, bytes]] | None = None
        self.allowed: frozenset[str] | None = None
        self.model_span: tuple[int, int] | None = None
        self.upstream_headers: tuple[Headers, Headers] | None = None
        self.traceparent: bytes | None = None

    def advance(self, to: int) -> None:
        """Move to state `to`; LifecycleError if the table has no such move."""
        if not (ENTERABLE[to] >> self.state) & 1:
            raise self.illegal(to)
        self.state = to

    def illegal(self, to: int) -> LifecycleError:
        return LifecycleError(f"request {self.method!r} {self.path!r}: "
                              f"{STATE_NAMES[self.state]} -> {STATE_NAMES[to]}")

    @property
    def done(self) -> bool:
        return self.state == DONE

    def release_body(self) -> None:
        """Give the body's arena segment back (idempotent): at the commit point, when no retry
        can need it any more (velox.relay.exchange), else when the request finishes."""
        segment = self.arena_segment
        if segment >= 0:
            self.arena_segment = -1
            if self.ends is not None:
                self.ends.release_segment(segment)

    def finish(self, status: int, bytes_out: int, holder: Holder | None) -> None:
        """The request is over (answered, refused, its client gone, its connection cut):
        the one place its end is handled. `holder`: what answered it, for the log line."""
        if self.state == DONE:
            raise LifecycleError(f"request {self.method!r} {self.path!r} finished twice")
        self.state = DONE
        ends = self.ends
        if ends is not None:
            ends.finished(self, status, bytes_out, holder)


# A stage of the pipeline: the requests that reached it in, those that go on out.
Stage = Callable[[list[Request]], list[Request]]
