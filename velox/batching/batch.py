"""Embeddings batching: /v1/embeddings calls of one group leave together as one upstream call.

A route opts in with `batch = { max_requests = 32, max_inputs = 2048, max_wait_ms = 20 }`
(`velox.config.tables.BatchSpec`). The worker offers every admitted request to `Batcher.offer`; a
non-streaming POST /v1/embeddings on such a route is taken, the others go on to dispatch.

Group commit. A request whose group has no upstream call in flight goes out at once: at the
end of the current loop pass (microseconds), together with any request of its group that
arrived in the same pass, so a burst leaves as one call instead of one request alone and the
rest waiting behind it; a lone request is sent unchanged (its own body, its own answer), so
batching adds no latency at low load. Requests that arrive while a call of their group is in
flight wait, and leave together as ONE upstream call when the batch is full (`max_requests`
members or `max_inputs` input items), `max_wait_ms` after the first of them arrived, or when
the group's last call in flight ends first (the upstream is idle for them: waiting on would
only add latency). A batch that ends up with one member is sent as that member's own request.

Only requests that could have been one call are merged: same path, same route (public model),
the same body apart from `input` (so `encoding_format`, `dimensions`, `user` and any other
parameter are equal; compared in canonical JSON), the same kind of input (strings or token
arrays: the API refuses a mix), the same forwarded headers (the merged call goes upstream with
its first member's headers on behalf of all, so an `OpenAI-Organization` or `OpenAI-Project`,
or any other header the upstream may act on, must be every member's; compared as a set,
without the hop-by-hop ones, the credential and `accept-encoding`, which the merged call
replaces, and without those that only describe the client's software: `user-agent`, `accept`
and the SDKs' `x-stainless-*`), and callers allowed to share: when every upstream the route
can reach has the gateway's own key, any callers; when the client's credential is passed
through, only requests presenting the same credential (`auth.caller_of`). Clients that send
other headers (a trace header per request, an idempotency key) are therefore not merged.
Batching is per worker: requests spread over N workers form up to N groups.

The merged call is a normal relay `Exchange` of a synthetic request whose `conn` is a
`BatchCall` (a `_types.Responder`, and the request's `Lifecycle`: its end is the call's),
sent like all that leaves a batch through the stage list (`Pipeline.run(..., "send-batched")`):
dispatch's routing, retries, failover and breakers apply unchanged, and a member whose client
leaves never cancels the call the others need (the call is cancelled only when every member has
left). The answer is split back: each member gets
exactly its own embeddings, in its order, `index` renumbered from 0 as if it had called
alone, `model` as upstream returned it, and `usage` shared in proportion to its input size
(characters of its strings, or its token count) with largest-remainder rounding, so the
parts add up exactly to the upstream's numbers (`split`, `apportion`).

Failures. A 400 of the merged call (one member's bad input fails the whole upstream call; or
a merged call its upstream kind refuses before sending, such as more texts than Cohere Embed
takes) sends every member again on its own (`EMB_SPLIT_RETRIES`), so one client's bad input
never fails its neighbours. Any other failure reaches every member as the error it would have
had alone: the same status, headers and OpenAI-shaped body. Every member is answered exactly
once; a member whose client left is skipped.

Lifecycle: a taken request is BATCHED (velox.core.types) and the worker counts it in flight.
It ends like any request, through its one `Request.finish`: answered its part or an error by
its merged call, or its client gone, with its `Member` as the holder (carrying the merged
call's timings, so the worker's latency histograms and the access log see the member's own
wait); or it leaves the batch BATCHED -> SENT through the stage list as its own request (a
batch of one, whose end is also its group's call's end: `LoneEnd`; or sent again after its
merged call's 400) and ends as any sent request does. Tokens: the
merged call's own meter settles the upstream's tpm for the whole call and books nothing
(`usage.NOT_BOOKED`); each member's share of the usage (`split`) settles its gateway key's
reservation and goes into its own key's token books (`book`, the worker's), and is the usage
its access-log line shows (`Member.meter`: one line per member, as for any request).
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from velox.config.tables import CATCH_ALL, BatchSpec, RouteSpec, Tables
from velox.core.errors import UpstreamProtocolError
from velox.core.fields import F
from velox.core.types import (
    ADMITTED,
    BATCHED,
    DONE,
    PARSED,
    Headers,
    Holder,
    Kind,
    Lifecycle,
    Pipeline,
    Request,
)
from velox.ingress.auth import caller_of
from velox.ingress.headers import HOP_BY_HOP
from velox.relay.usage import NOT_BOOKED, input_estimate, usage_of

EMBEDDINGS = b"/v1/embeddings"
_STRINGS, _TOKENS = 0, 1
_BATCH_HEADER = b"x-velox-batch"
_ACCEPT_ENCODING = b"accept-encoding"
_CONTENT_ENCODING = b"content-encoding"
_PLAIN = (b"identity", b"")
# Request headers left out of the group key: those that never go upstream as the client sent
# them (hop-by-hop and framing; the credential, keyed separately when it is passed through),
# accept-encoding, which the merged call replaces, and those that only describe the client's
# software (the SDKs send their version, OS and runtime, and a retry count, on every request).
_NOT_KEYED = HOP_BY_HOP | {b"authorization", _ACCEPT_ENCODING, b"user-agent", b"accept"}
_SDK_INFO = b"x-stainless-"
# A merged call's request is admitted by its members' admission: its way to BATCHED.
_MERGED_WAY = (PARSED, ADMITTED, BATCHED)


class Member:
    """One client request waiting in, or carried by, a merged call.

    It stands in for the request's exchange while the batcher holds the request: ingress
    calls `client_gone` on it when the client leaves, and the request's end (the worker's
    accounting, the access log) reads the answering call's attributes from it."""

    __slots__ = ("request", "items", "weight", "group", "call", "gone", "done",
                 "t_sent", "t_headers", "upstream_name", "attempts", "headers", "meter", "book")

    streaming = False

    def __init__(self, request: Request, items: list[Any], weight: int,
                 book: Callable[[Request, int, int, Any], None] | None = None) -> None:
        self.request = request
        self.items = items
        self.weight = weight  # its share of the merged call's usage
        self.group: Group | None = None  # while waiting in its group's pending batch
        self.call: BatchCall | None = None  # while carried by a merged call
        self.gone = False  # the client left
        self.done = False  # answered (or handed to an exchange of its own)
        self.t_sent = 0
        self.t_headers = 0
        self.upstream_name = b""
        self.attempts = 0
        self.headers: Headers = []
        # Its share of the merged call's usage once answered (what the access log reads off
        # an exchange's meter), None until then or when the answer carried none.
        self.meter: Share | None = None
        self.book = book  # into its own key's token books (the worker's; None: no books)

    @property
    def live(self) -> bool:
        return not (self.gone or self.done)

    def client_gone(self) -> None:
        if not self.live:
            return
        self.gone = True
        request = self.request
        request.exchange = None
        ticket = request.ticket
        if ticket is not None:  # its key's reservation: the answer will not reach it now
            # Carried by a call: the upstream reads its input (as a lone request's meter
            # charges a client gone mid-call); still waiting: nothing of it was sent.
            ticket.settle(input_estimate(request.body) if self.call is not None else 0)
        group = self.group
        if group is not None:  # still waiting: it no longer counts towards a full batch
            self.group = None
            group.pending.remove(self)
            group.inputs -= len(self.items)
            if not group.pending and group.timer is not None:  # nobody left to send: its
                group.timer.cancel()  # max_wait timer would only hold the group until then
                group.timer = None
        call = self.call
        if call is not None:
            call.member_left()

    def client_writable(self) -> None:
        """Nothing is streamed to a member: nothing to resume."""

    def answer(self, status: int, headers: Headers, body: bytes, exchange: Any) -> None:
        if not self.live:
            return
        self.done = True
        if exchange is not None:
            self.t_sent, self.t_headers = exchange.t_sent, exchange.t_headers
            self.upstream_name, self.attempts = exchange.upstream_name, exchange.attempts
        self.headers = headers
        request = self.request
        used = usage_of(body) if status == 200 else None
        if used is not None:
            self.meter = Share(*used)
            if self.book is not None:  # the merged call's exchange: what answered, to price
                self.book(request, used[0], used[1], exchange)
        ticket = request.ticket
        if ticket is not None:  # its gateway key's reservation: settled from its own share
            ticket.settle(used[0] + used[1] if used is not None else 0)
            if used is not None:
                ticket.key.used(*used)  # its own token count (any key)
        request.conn.respond(request, status, headers, body)  # its end (Request.finish)
        request.exchange = None

    def fail(self, exc: BaseException) -> None:
        if not self.live:
            return
        self.done = True
        request = self.request
        if request.ticket is not None:
            request.ticket.settle(0)  # no answer: nothing generated for it
        request.conn.respond_error(request, exc)  # its end (Request.finish)
        request.exchange = None


class Share:
    """A member's tokens: the meter fields the access log reads (velox.relay.usage.TokenMeter's)."""

    __slots__ = ("input", "output", "cost")

    exact = True  # read from the upstream's usage, apportioned
    done = True

    def __init__(self, inp: int, out: int) -> None:
        self.input = inp
        self.output = out
        self.cost: int | None = None  # nano-USD of this share, once priced (velox.spend)


class Group:
    """Requests that may share a call, and that group's calls in flight."""

    __slots__ = ("key", "spec", "template", "pending", "inputs", "calls", "timer", "soon")

    def __init__(self, key: tuple[object, ...], spec: BatchSpec, template: dict[str, Any]) -> None:
        self.key = key
        self.spec = spec
        self.template = template  # the body without `input` (the same for every member)
        self.pending: list[Member] = []
        self.inputs = 0  # input items of the pending members
        self.calls = 0  # upstream calls of this group in flight
        self.timer: asyncio.TimerHandle | None = None
        self.soon = False  # a departure at the end of this loop pass is scheduled


class Batcher:
    """One worker's batching stage (see the module docstring)."""

    __slots__ = ("routes", "catch_all", "pipeline", "loop", "counters", "slot", "groups", "book")

    def __init__(self, tables: Tables, pipeline: Pipeline, loop: asyncio.AbstractEventLoop,
                 counters: Any, slot: int,
                 book: Callable[[Request, int, int, Any], None] | None = None) -> None:
        # Public model -> (spec, may callers share) for routes that batch; None for the others.
        by_model = {r.model: r for r in tables.routes}
        entries = {r.model: (r.batch, _shared(r, by_model, tables)) if r.batch else None
                   for r in tables.routes}
        self.catch_all = entries.pop(CATCH_ALL, None)
        self.routes = entries
        # The worker's stage list: what leaves is sent from its "send-batched" stage, and written
        # upstream by the run's end.
        self.pipeline = pipeline
        self.loop = loop
        self.counters = counters
        self.slot = slot
        self.groups: dict[tuple[object, ...], Group] = {}
        # (request, input, output) into the request's key's token books: a merged call's
        # members book their shares themselves (the call books nothing); None: no books.
        self.book = book

    @staticmethod
    def wanted(tables: Tables) -> bool:
        return any(r.batch is not None for r in tables.routes)

    # --- the stage ---------------------------------------------------------------------------

    def offer(self, request: Request) -> bool:
        """Take `request` if it is an embeddings call of a batching route (then the batcher
        answers it, exactly once); False: the caller sends it as usual."""
        if request.stream or request.method != b"POST" or \
                request.path.split(b"?", 1)[0] != EMBEDDINGS:
            return False
        model = request.model
        entry = self.catch_all if model is None else self.routes.get(model, self.catch_all)
        if entry is None:
            return False
        spec, shared = entry
        try:
            doc = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            return False
        if type(doc) is not dict:
            return False
        found = _items(doc.get("input"))
        if found is None:
            return False  # not an input the API accepts: upstream answers it, alone
        items, kind = found
        if len(items) > spec.max_inputs:
            return False
        template = {k: v for k, v in doc.items() if k != "input"}
        # Members share a call only under the same allow-list: the call's fallbacks are
        # limited to it (balance.Router.plan).
        key = (request.path, kind, orjson.dumps(template, option=orjson.OPT_SORT_KEYS),
               b"" if shared else caller_of(request), _forwarded(request.headers),
               request.allowed)
        # The body may live in the arena, whose segment is reused once released: keep a copy
        # (a split retry sends it again) and release the segment now.
        request.body = bytes(request.body)
        request.release_body()
        # BATCHED before it may leave (a batch full with it: it may be a batch of one).
        request.advance(BATCHED)
        member = Member(request, items, _weight(items), self.book)
        request.exchange = member
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = Group(key, spec, template)
        if group.pending and group.inputs + len(items) > spec.max_inputs:
            self._leave(group, F.EMB_FULL_BATCHES)
        group.pending.append(member)
        member.group = group
        group.inputs += len(items)
        if len(group.pending) >= spec.max_requests or group.inputs >= spec.max_inputs:
            self._leave(group, F.EMB_FULL_BATCHES)
        elif group.calls == 0:
            self._soon(group)
        elif group.timer is None:
            group.timer = self.loop.call_later(spec.max_wait_ms / 1000, self._timed_out, group)
        return True

    def _soon(self, group: Group) -> None:
        """Nothing of the group is in flight: its waiting requests leave at once, at the end
        of this loop pass, so requests of a burst that arrived in the same pass (a batch's
        clients sending their next request together) leave as one call, not one alone and
        the rest behind it."""
        if not group.soon:
            group.soon = True
            self.loop.call_soon(self._now, group)

    def _now(self, group: Group) -> None:
        group.soon = False
        if group.calls == 0 and group.pending:
            self._leave(group, F.EMB_IMMEDIATE_BATCHES)
        else:
            self._forget(group)

    def _timed_out(self, group: Group) -> None:
        group.timer = None
        self._leave(group, F.EMB_TIMEOUT_BATCHES)

    def _leave(self, group: Group, reason: int) -> None:
        """The pending members leave now, as one call (or alone when only one is left)."""
        members = group.pending
        group.pending = []
        for member in members:
            member.group = None
        group.inputs = 0
        if group.timer is not None:
            group.timer.cancel()
            group.timer = None
        if not members:
            self._forget(group)
            return
        counters, slot = self.counters, self.slot
        counters.add(slot, F.EMB_BATCHES, 1)
        counters.add(slot, F.EMB_BATCH_MEMBERS, len(members))
        counters.add(slot, reason, 1)
        group.calls += 1
        if len(members) == 1:  # its own request, unchanged: nothing to merge or split
            member = members[0]
            member.done = True
            request = member.request
            request.ends = LoneEnd(self, group, request.ends)  # its end is the group's call's
            self.pipeline.run([request], "send-batched")
            return
        call = BatchCall(self, group, members)
        for member in members:
            member.call = call
        first = members[0].request
        body = orjson.dumps({**group.template,
                             "input": [item for m in members for item in m.items]})
        now = time.perf_counter_ns()
        # The answer is parsed and split here, so it must come back uncompressed.
        headers = [h for h in first.headers if h[0] != _ACCEPT_ENCODING]
        merged = Request(call, b"POST", first.path, Kind.MODEL_CALL, headers, body, True, now,
                         ends=call)
        for state in _MERGED_WAY:  # admitted by its members' admission
            merged.advance(state)
        merged.model = first.model
        merged.upstream_path = first.upstream_path
        merged.affinity = first.affinity
        merged.caller = first.caller
        merged.key = NOT_BOOKED  # the members book their own shares (Member.answer)
        merged.allowed = first.allowed
        merged.t_popped = merged.t_parsed = merged.t_admitted = now
        call.request = merged
        self.pipeline.run([merged], "send-batched")

    def call_done(self, group: Group) -> None:
        """One of the group's calls in flight is over (its request finished)."""
        group.calls -= 1
        if group.calls == 0 and group.pending:
            self._soon(group)  # the upstream is idle for this group: no reason to wait on
        self._forget(group)

    def _forget(self, group: Group) -> None:
        if group.calls == 0 and not group.pending and not group.soon and \
                self.groups.get(group.key) is group:
            del self.groups[group.key]

    def split_retry(self, members: list[Member]) -> None:
        """Send each member again on its own (after a 400 of their merged call)."""
        alone = []
        for member in members:
            if member.live:
                member.done = True
                member.call = None
                alone.append(member.request)
        if alone:
            self.counters.add(self.slot, F.EMB_SPLIT_RETRIES, len(alone))
            self.pipeline.run(alone, "send-batched")


class LoneEnd:
    """The end (`Lifecycle`) of a batch of one sent as its own request: its group's call is
    over, then the request's own end (the worker's) follows."""

    __slots__ = ("batcher", "group", "ends")

    def __init__(self, batcher: Batcher, group: Group, ends: Lifecycle | None) -> None:
        self.batcher = batcher
        self.group = group
        self.ends = ends

    def release_segment(self, segment: int) -> None:
        if self.ends is not None:
            self.ends.release_segment(segment)

    def finished(self, request: Request, status: int, bytes_out: int,
                 holder: Holder | None) -> None:
        self.batcher.call_done(self.group)
        if self.ends is not None:
            self.ends.finished(request, status, bytes_out, holder)


class BatchCall:
    """The client side (`_types.Responder`) of one merged call: receives the upstream's whole
    answer and gives each member its part. It is also its request's `Lifecycle`: the call's
    request finishes (once, whichever way the call ended) when the answer or error has been
    handed to the members, or when the last member left, and that ends the group's call."""

    __slots__ = ("batcher", "group", "members", "request", "status", "headers", "chunks",
                 "over")

    closed = False
    write_paused = False
    queued = 0  # the members' connections queue their own parts

    def __init__(self, batcher: Batcher, group: Group, members: list[Member]) -> None:
        self.batcher = batcher
        self.group = group
        self.members = members
        self.request: Request | None = None
        self.status = 0
        self.headers: Headers = []
        self.chunks: list[bytes] = []
        self.over = False  # the answer (or its failure) reached the members

    def member_left(self) -> None:
        """A member's client left: when none is left, cancel the call (nobody needs it)."""
        if self.over or any(m.live for m in self.members):
            return
        self.over = True
        request = self.request
        exchange = request.exchange if request is not None else None
        if exchange is not None:
            exchange.client_gone()
        self._end(499)

    def _end(self, status: int) -> None:
        request = self.request
        if request is not None and request.state != DONE:
            request.finish(status, 0, request.exchange)

    # --- Lifecycle (of the merged call's request) ------------------------------------------

    def release_segment(self, segment: int) -> None:
        """Its body is its own bytes, never an arena segment."""

    def finished(self, request: Request, status: int, bytes_out: int,
                 holder: Holder | None) -> None:
        self.batcher.call_done(self.group)

    # --- Responder ----------------------------------------------------------------------------

    def respond(self, request: Request, status: int, headers: Sequence[tuple[bytes, bytes]],
                body: bytes | memoryview) -> None:
        if self.over:
            return
        self.over = True
        self._answer(request, status, headers, body)
        self._end(status)

    def _answer(self, request: Request, status: int, headers: Sequence[tuple[bytes, bytes]],
                body: bytes | memoryview) -> None:
        exchange = request.exchange
        members = self.members
        if status == 400:
            self.batcher.split_retry(members)
            return
        coding = next((v.strip().lower() for n, v in headers if n == _CONTENT_ENCODING), b"")
        out = [h for h in headers if h[0] != _CONTENT_ENCODING]
        out.append((_BATCH_HEADER, b"%d" % len(members)))
        parts: list[bytes] | None = None
        try:
            # Asked for without compression; an upstream that compresses anyway (gzip or
            # zlib) is decoded, since every member's part is built anew.
            whole = bytes(body) if coding in _PLAIN else zlib.decompress(body, 47)
            if status == 200:
                parts = split(whole, [len(m.items) for m in members],
                              [m.weight for m in members])
        except (zlib.error, ValueError, TypeError, KeyError) as exc:
            error = UpstreamProtocolError(
                f"The upstream's answer to a batched embeddings call could not be split: {exc}")
            for member in members:
                member.fail(error)
            return
        for k, member in enumerate(members):  # any other failure: as each would have had it
            member.answer(status, out, parts[k] if parts is not None else whole, exchange)

    def respond_error(self, request: Request, exc: BaseException) -> None:
        if self.over:
            return
        self.over = True
        status = getattr(exc, "status", 502)
        if status == 400:
            # Refused before sending: the merged call is what its upstream cannot take (over
            # Cohere Embed's 96 texts on a bedrock route), not necessarily any member: each
            # goes alone, as after an upstream's 400.
            self.batcher.split_retry(self.members)
        else:
            for member in self.members:
                member.fail(exc)
        self._end(status)

    def start_stream(self, request: Request, status: int,
                     headers: Sequence[tuple[bytes, bytes]]) -> None:
        # The relay streams plain answers past 1 MiB; a merged embeddings answer can be that
        # large, so the pieces are collected and split when the last one arrives.
        self.status = status
        self.headers = list(headers)
        self.chunks = []

    def send_chunk(self, data: bytes) -> None:
        self.chunks.append(data)

    def end_stream(self) -> None:
        request = self.request
        if request is not None:
            self.respond(request, self.status, self.headers, b"".join(self.chunks))
        self.chunks = []

    def abort(self) -> None:
        if self.over:
            return
        self.over = True
        error = UpstreamProtocolError("The upstream's answer to a batched embeddings call "
                                      "broke off.")
        for member in self.members:
            member.fail(error)
        self._end(error.status)


# --- the split (pure) ---------------------------------------------------------------------------


def split(body: bytes, sizes: list[int], weights: list[int]) -> list[bytes]:
    """The merged call's 200 answer as one body per member: member k gets the `sizes[k]`
    embeddings after those of the members before it, `index` renumbered from 0, and its share
    of every usage count (in proportion to `weights`; see `apportion`). Raises ValueError when
    the answer does not hold exactly one embedding per input."""
    doc = orjson.loads(body)
    if type(doc) is not dict or type(doc.get("data")) is not list:
        raise ValueError("no `data` list")
    data = doc["data"]
    total = sum(sizes)
    if len(data) != total:
        raise ValueError(f"{len(data)} embeddings for {total} inputs")
    ordered: list[Any] = [None] * total
    for item in data:
        index = item["index"] if type(item) is dict else None
        if type(index) is not int or not 0 <= index < total or ordered[index] is not None:
            raise ValueError(f"bad or repeated index {index!r}")
        ordered[index] = item
    usage = doc.get("usage")
    shares = apportion_usage(usage, weights) if type(usage) is dict else None
    parts = []
    start = 0
    for k, size in enumerate(sizes):
        own = []
        for i in range(size):
            item = dict(ordered[start + i])
            item["index"] = i
            own.append(item)
        start += size
        part = dict(doc)
        part["data"] = own
        if shares is not None:
            part["usage"] = shares[k]
        parts.append(orjson.dumps(part))
    return parts


def apportion(total: int, weights: list[int]) -> list[int]:
    """`total` shared in proportion to `weights` in whole numbers that add up to `total`
    exactly: each share rounded down, the rest given one by one to the largest remainders
    (ties: the earlier member), Hamilton's method."""
    whole = sum(weights)
    if whole <= 0:
        weights = [1] * len(weights)
        whole = len(weights)
    shares = [total * w // whole for w in weights]
    left = total - sum(shares)
    order = sorted(range(len(weights)), key=lambda k: (-(total * weights[k] % whole), k))
    for k in order[:left]:
        shares[k] += 1
    return shares


def apportion_usage(usage: dict[str, Any], weights: list[int]) -> list[dict[str, Any]]:
    """One usage object per member: every integer count (nested objects too, such as
    `prompt_tokens_details`) apportioned; other values copied."""
    parts: list[dict[str, Any]] = [{} for _ in weights]
    for name, value in usage.items():
        if type(value) is int:
            for part, share in zip(parts, apportion(value, weights), strict=True):
                part[name] = share
        elif type(value) is dict:
            for part, sub in zip(parts, apportion_usage(value, weights), strict=True):
                part[name] = sub
        else:
            for part in parts:
                part[name] = value
    return parts


def _items(value: Any) -> tuple[list[Any], int] | None:
    """The input items and their kind (strings or token arrays), or None for a shape the
    API does not accept (left to the upstream to refuse, unbatched)."""
    if type(value) is str:
        return [value], _STRINGS
    if type(value) is not list or not value:
        return None
    if all(type(v) is int for v in value):
        return [value], _TOKENS
    if all(type(v) is str for v in value):
        return value, _STRINGS
    if all(type(v) is list and all(type(t) is int for t in v) for v in value):
        return value, _TOKENS
    return None


def _forwarded(headers: Headers) -> tuple[tuple[bytes, bytes], ...]:
    """The headers that would go upstream with the request, as a set (the group key's part)."""
    return tuple(sorted(h for h in headers
                        if h[0] not in _NOT_KEYED and not h[0].startswith(_SDK_INFO)))


def _weight(items: list[Any]) -> int:
    """A member's input size: characters of its strings, or its tokens (at least 1 each)."""
    return sum(max(1, len(item)) for item in items)


def _shared(route: RouteSpec, by_model: dict[str, RouteSpec], tables: Tables) -> bool:
    """Callers may share a call when every upstream the route (or its fallbacks) can reach
    sends the gateway's own key; otherwise the client's credential is passed through."""
    seen: set[str] = set()
    todo = [route]
    while todo:
        r = todo.pop()
        if r.model in seen:
            continue
        seen.add(r.model)
        for target in r.targets:
            if not tables.upstream(target.upstream).api_key:
                return False
        todo += [by_model[f] for f in r.fallbacks if f in by_model]
    return True
