"""Traces wired into one worker (VELOX_OTEL_ENDPOINT): what velox.spend.trace needs from the
request path, put in place by `Traced.install` only when tracing is on. A gateway without it
runs none of this: no stage, no wrapper, no per-request state (the worker tests one attribute,
at build and on its tick).

When on, these hooks, each taking the place of a call the worker makes anyway:

* the parse stage decides each request's trace as a batch enters it (`Traced.sample`): a
  client's `traceparent` is followed, else a request is sampled at VELOX_OTEL_SAMPLE by a
  countdown to the next sampled one (trace.next_sampled: geometric gaps, the same odds as
  a draw per request). A batch with no client's `traceparent` and no sample due costs one
  subtraction and one count of its `traceparent` fields at C speed: an unsampled request has
  no trace id, no entry, no header and no hook of its own. A traced request (sampled, or its
  client's) gets an entry in `Traced.live` and an end of its own (`_TracedEnd`);
* while a traced request is in flight (only then: a wrapper's call cost ~0.13 us an attempt,
  timeit), the dispatcher's upstreams are wrapped (`_TracedUpstream.submit`): a traced
  request's attempt gets its own span id and sends `traceparent` naming it (its sampled flag
  as decided), and a sampled attempt is noted with its start;
* dispatch's failure paths tell `attempt_failed` the status or error of an attempt that is
  retried or answered as it failed;
* with a cache, a stage after it notes when a request left it (a miss); one answered without
  reaching that stage or any upstream was the cache's (a hit, or coalesced);
* a merged batch call (velox.batching) gets a trace of its own when any of its members is
  sampled: a CLIENT span per attempt, made when its exchange ends, linked to the members'
  SERVER spans, which link back to it;
* a traced request's end (`_TracedEnd.finished`): once the worker counted and logged it, its
  record is built from the timestamps it carries and handed to the tracer, which turns only
  a sampled one into spans (queued in memory for the exporter's thread).

An unsampled request without a client's `traceparent` sends none upstream: the upstream's side
decides for itself, as without the gateway (sending one would cost each request a trace id,
its hex and a header: ~1.5 us of the ~1.7 us tracing cost an unsampled request before,
benches/bench_trace.py).

A sampled request's exchange also gets an observer (wrapping the cache's, if any) keeping the
first 256 KiB of its answer as the client gets it, from which the export thread reads the
response model, finish reasons and usage (RequestRecord.read_answer). Contents are never
recorded: only those fields are read from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from operator import attrgetter, countOf
from random import getrandbits, random
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from velox.batching.batch import BatchCall
from velox.cache.wait import Waiting
from velox.core.fields import F
from velox.core.types import DONE
from velox.relay.exchange import Exchange
from velox.spend.trace import (
    AttemptSpan,
    RequestRecord,
    RequestTrace,
    Tracer,
    next_sampled,
    sampled_trace_id,
)

if TYPE_CHECKING:
    from velox.config.tables import UpstreamSpec
    from velox.core.types import Headers, Holder, Lifecycle, Request

log = logging.getLogger("velox.trace")

TRACEPARENT = b"traceparent"
_TRACEPARENT_OF = attrgetter("traceparent")
# What the observer keeps of a sampled answer: a chat answer's fields of interest are in its
# first bytes (model) and last (finish reason, usage); 256 KiB holds any non-streamed answer
# but a huge one, whose fields are then read from what was kept.
_KEEP_BYTES = 256 * 1024
# gen_ai.operation.name by the path's ending (OpenAI's paths, Azure's deployment paths, the
# Messages API).
_OPERATIONS = ((b"/chat/completions", "chat"), (b"/embeddings", "embeddings"),
               (b"/completions", "text_completion"), (b"/messages", "chat"),
               (b"/responses", "chat"))


class _Live:
    """A traced request's trace while it runs (sampled, or its client's `traceparent`
    followed): its attempts (sampled only) and what it kept. An unsampled request without a
    client's `traceparent` has none."""

    __slots__ = ("trace", "parented", "attempts", "keeper", "cache_ns", "links")

    def __init__(self, trace: RequestTrace, parented: bool) -> None:
        self.trace = trace
        self.parented = parented  # the client sent a traceparent (replaced upstream)
        self.attempts: list[AttemptSpan] = []
        self.keeper: _Keeper | None = None
        self.cache_ns = 0
        # (trace id, span id) of spans in other traces: a batched member's merged call's
        # attempts, a merged call's sampled members' server spans.
        self.links: list[tuple[int, int]] = []


class Traced:
    """Tracing in one worker: the tracer, the hooks, and the requests in flight."""

    def __init__(self, tracer: Tracer, counters: Any, slot: int) -> None:
        self.tracer = tracer
        self.counters = counters
        self.slot = slot
        # By id(request), from its decision (`sample`) to its end: traced requests only, and a
        # merged batch call with a sampled member. While it holds any, the dispatcher sends
        # through `wrapped` (else `plain`, the upstreams themselves).
        self.live: dict[int, _Live] = {}
        self.dispatch: Any = None
        self.plain: list[Any] = []
        self.wrapped: list[_TracedUpstream] = []
        # Requests to enter the pipeline until the next sampled one (1: the next).
        self.countdown = next_sampled(tracer.sample, random())
        self.cached = False
        # The worker's parse stage, which `sample` takes the place of.
        self._parse: Callable[[list[Request]], list[Request]] = list
        self._counted = (0, 0)  # exported, dropped: already added to the shared counters
        self._failed_once = False
        # request.key -> the key's name (the worker publishes a longer tuple as run-time keys
        # are made: Worker.publish_key_names).
        self.key_names: tuple[str, ...] = ()

    def install(self, worker: Any) -> None:
        """Put the hooks in place (at build, after the worker's stages and dispatch exist)."""
        dispatch = self.dispatch = worker.dispatch
        self.plain = dispatch.upstreams
        self.wrapped = [_TracedUpstream(self, u, spec) for u, spec in
                        zip(self.plain, worker.tables.upstreams, strict=True)]
        dispatch.tracer = self
        if any(name == "cache" for name, _ in worker.stages):
            self.cached = True
            worker.add_stage("traced-cache", self._after_cache, "limit")
        # Before parse, so a request it refuses (400) has its server span too. A batch enters
        # "parse" once per pass: a request scanned off the loop enters twice (`sample` leaves
        # the second pass alone).
        self._parse = dict(worker.stages)["parse"]
        worker.replace_stage("parse", self.sample)
        self.key_names = tuple(k.name for k in worker.tables.keys)
        worker.add_key_name_reader(self)

    # --- the request path --------------------------------------------------------------------

    def sample(self, batch: list[Request]) -> list[Request]:
        """The parse stage, after the batch's traces are decided. Most batches hold no sampled
        request and no client's `traceparent`: a subtraction, a comparison and one count at C
        speed (`countOf` over the batch's `traceparent` fields, ~15 ns a request)."""
        left = self.countdown - len(batch)
        plain = countOf(map(_TRACEPARENT_OF, batch), None) == len(batch)
        if left > 0 and plain:
            self.countdown = left
        elif plain:
            self.due(batch)
        else:
            self.decide(batch)
        return self._parse(batch)

    def due(self, batch: list[Request]) -> None:
        """The sampled requests of a batch without a client's `traceparent`: only those the
        countdown falls on are looked at (a loop over the whole batch in Python is several us,
        and at 1% this path runs cold). A request it falls on that is not to be traced
        (`_traceable`) passes the sample to the next one."""
        size = len(batch)
        at = max(self.countdown - 1, 0)  # the index of the request due
        while at < size:
            request = batch[at]
            if not _traceable(request):
                at += 1
                continue
            gap = next_sampled(self.tracer.sample, random())  # drawn first, as `decide` does
            self._start(request, None)
            at += gap
        self.countdown = at - size + 1
        if self.live:
            self.dispatch.upstreams = self.wrapped

    def decide(self, batch: list[Request]) -> None:
        """The traces of a batch with a client's `traceparent`, request by request. A request
        seen before (back from the off-loop scan: its t_popped is set) or already over (its
        client left while it queued) is left as it is; a sample due on it goes to the next
        request."""
        countdown = self.countdown
        live = self.live
        for request in batch:
            countdown -= 1
            traceparent = request.traceparent
            if (traceparent is None and countdown > 0) or not _traceable(request):
                continue
            if traceparent is None:  # a sample due
                countdown = next_sampled(self.tracer.sample, random())
            self._start(request, traceparent)
        self.countdown = countdown
        if live:
            self.dispatch.upstreams = self.wrapped

    def _start(self, request: Request, traceparent: bytes | None) -> None:
        """The request's trace: a new sampled one, or the client's (a new trace when its
        `traceparent` is not valid); its entry, and its end of its own."""
        if traceparent is None:
            ratio = self.tracer.sample
            trace = RequestTrace(sampled_trace_id(ratio), getrandbits(64) or 1, 0, True)
            entry = _Live(trace, False)
        else:
            entry = _Live(self.tracer.start(traceparent), True)
        ends = request.ends
        assert ends is not None  # _traceable
        self.live[id(request)] = entry
        request.ends = _TracedEnd(self, ends)

    def _after_cache(self, requests: list[Request]) -> list[Request]:
        live = self.live
        if live:
            now = time.perf_counter_ns()
            for request in requests:
                entry = live.get(id(request))
                if entry is not None:  # unsampled: no span to put the event in
                    entry.cache_ns = now
        return requests

    def attempt(self, exchange: Any, live: _Live, up: _TracedUpstream) -> None:
        """An attempt of a traced request is about to be sent: its traceparent, and its
        start when sampled."""
        trace = live.trace
        span_id = trace.new_span_id()
        headers = exchange.headers_out
        if live.parented:  # the client's own header goes no further: ours names the attempt
            headers = [h for h in headers if h[0] != TRACEPARENT]
        exchange.headers_out = [*headers, (TRACEPARENT, trace.traceparent(span_id))]
        if not trace.sampled:
            return
        if live.keeper is None:
            live.keeper = exchange.observer = _Keeper(exchange.observer)
        route_attempt = exchange.routing.attempt
        model = route_attempt.model if route_attempt is not None else \
            exchange.request.model or ""
        live.attempts.append(AttemptSpan(span_id, up.name, up.kind, up.address, up.port, model,
                                     time.perf_counter_ns(), 0))

    def batch_attempt(self, exchange: Any, request: Request, live: _Live | None,
                      up: _TracedUpstream) -> None:
        """An attempt of a merged batch call (velox.batching.batch.BatchCall) is about to be
        sent. The call is traced when any member is sampled, in a trace of its own: its CLIENT
        spans (one per attempt) link to the sampled members' SERVER spans, and those link
        back. Otherwise it goes as an unsampled request does."""
        members = request.conn.members  # type: ignore[attr-defined]  # a BatchCall
        if live is None:
            sampled = []
            for member in members:
                entry = self.live.get(id(member.request)) if member.live else None
                if entry is not None and entry.trace.sampled:
                    sampled.append(entry)
            if not sampled:
                return
            trace_id = getrandbits(128) or 1
            live = self.live[id(request)] = _Live(RequestTrace(trace_id, 0, 0, True), False)
            live.links = [(e.trace.trace_id, e.trace.span_id) for e in sampled]
            # Its spans are made, and its entry dropped, when the call ends (its exchange's
            # on_done; no `finished` ends a call of the gateway's own).
            on_done = exchange.on_done
            exchange.on_done = lambda ex, status: self._batch_done(ex, status, on_done)
        self.attempt(exchange, live, up)
        if live.attempts:  # each sampled member links to this attempt's span
            link = (live.trace.trace_id, live.attempts[-1].span_id)
            for member in members:
                own = self.live.get(id(member.request))
                if own is not None and own.trace.sampled:
                    own.links.append(link)

    def _batch_done(self, exchange: Any, status: int, on_done: Any) -> None:
        """A merged call is over: its spans, then the call's own end."""
        request = exchange.request
        live = self._forget(request)
        if live is not None:
            try:
                self.tracer.record(self._call_record(request, exchange, status, live))
            except Exception:  # a tracing bug costs spans, never the worker
                self._failed(log)
        on_done(exchange, status)

    def _forget(self, request: Request) -> _Live | None:
        """The request's entry, taken out; the last one out unwraps the upstreams."""
        live = self.live
        entry = live.pop(id(request), None)
        if not live:
            self.dispatch.upstreams = self.plain
        return entry

    def attempt_failed(self, exchange: Any, status: int, error: str) -> None:
        """The current attempt failed (dispatch: before it is retried, or answered as is)."""
        live = self.live.get(id(exchange.request))
        if live is not None and live.attempts:
            attempt = live.attempts[-1]
            attempt.end_ns = time.perf_counter_ns()
            attempt.status = status
            attempt.error = error or str(status)

    def ended(self, request: Request, status: int, holder: Holder | None) -> None:
        """A traced request is over (the worker counted and logged it): its spans when it is
        sampled."""
        live = self._forget(request)
        if live is None or not live.trace.sampled:
            return
        try:
            self.tracer.record(self._record(request, status, holder, live))
        except Exception:  # a tracing bug costs spans, never the worker
            self._failed(log)

    def _failed(self, logger: logging.Logger) -> None:
        if not self._failed_once:
            self._failed_once = True
            logger.exception("a request's spans could not be made; tracing goes on")

    def _record(self, request: Request, status: int, holder: Holder | None,
                live: _Live) -> RequestRecord:
        end = time.perf_counter_ns()
        path = request.path.partition(b"?")[0]
        attempts = live.attempts
        _closed(live, holder.status if isinstance(holder, Exchange) else 0, status, end)
        cache_ns, cache_hit = live.cache_ns, None
        if cache_ns:
            cache_hit = False
        elif self.cached and not attempts and status < 300 and request.t_admitted == 0 \
                and (holder is None or type(holder) is Waiting):
            cache_ns, cache_hit = end, True  # answered from the cache, or coalesced
        exchange = holder if isinstance(holder, Exchange) else None
        route_attempt = exchange.routing.attempt if exchange is not None else None
        # The priced meter's (or a batched member's share's) nano-USD; None: unknown or unpriced.
        meter = getattr(holder, "meter", None) if holder is not None else None
        cost = getattr(meter, "cost", None)
        share = (meter.input, meter.output) if live.links and meter is not None else None
        key, names = request.key, self.key_names
        return RequestRecord(
            live.trace, _operation(path), request.method.decode("latin-1"),
            path.decode("latin-1"), request.model or "", status, request.t_received, end,
            queued_ns=request.t_popped, parsed_ns=request.t_parsed,
            limits_ns=request.t_admitted, cache_ns=cache_ns, cache_hit=cache_hit,
            answer=_kept(live), share_tokens=share, attempts=attempts, links=live.links,
            key=names[key] if 0 <= key < len(names) else "",
            route=route_attempt.route.model if route_attempt is not None else "",
            cost_nanos=cost if type(cost) is int else None)

    def _call_record(self, request: Request, exchange: Any, status: int,
                     live: _Live) -> RequestRecord:
        """A merged batch call's record: its attempts, linked to its sampled members."""
        end = time.perf_counter_ns()
        path = request.path.partition(b"?")[0]
        _closed(live, exchange.status, status, end)
        return RequestRecord(
            live.trace, _operation(path), request.method.decode("latin-1"),
            path.decode("latin-1"), request.model or "", status, request.t_received, end,
            answer=_kept(live), attempts=live.attempts, links=live.links,
            members=len(request.conn.members))  # type: ignore[attr-defined]  # a BatchCall

    # --- the rest ------------------------------------------------------------------------------

    def tick(self) -> None:
        """The worker's tick: the exporter's counts into the shared counters (/metrics)."""
        stats = self.tracer.stats()
        exported, dropped = stats["exported"], stats["dropped"] + stats["failed"]
        was_exported, was_dropped = self._counted
        if exported != was_exported or dropped != was_dropped:
            self.counters.add_many(self.slot, int(F.TRACE_SPANS_EXPORTED),
                                   exported - was_exported, int(F.TRACE_SPANS_DROPPED),
                                   dropped - was_dropped)
            self._counted = (exported, dropped)

    def close(self) -> None:
        """The worker stops: what waits is exported, within the tracer's bounded wait."""
        self.tracer.close()
        self.tick()


class _TracedUpstream:
    """An upstream (egress.interfaces.Egress) whose requests carry their trace."""

    __slots__ = ("traced", "inner", "name", "kind", "address", "port")

    def __init__(self, traced: Traced, inner: Any, spec: UpstreamSpec) -> None:
        self.traced = traced
        self.inner = inner
        self.name = spec.name
        self.kind = spec.kind
        parts = urlsplit(spec.origin)
        self.address = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)

    def submit(self, client: Any, number: int = 0) -> None:
        request = getattr(client, "request", None)  # a breaker probe has none
        if request is not None:
            traced = self.traced
            entry = traced.live.get(id(request))
            if type(request.conn) is BatchCall:  # a merged batch call: no client's request
                traced.batch_attempt(client, request, entry, self)
            elif entry is not None:
                traced.attempt(client, entry, self)
        self.inner.submit(client, number)

    def flush(self) -> None:
        self.inner.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _TracedEnd:
    """A traced request's end (`Lifecycle`, in place of the worker's): the worker's, then the
    request's spans (`Traced.ended`). Only traced requests have one, so the others' end costs
    tracing nothing."""

    __slots__ = ("traced", "ends")

    def __init__(self, traced: Traced, ends: Lifecycle) -> None:
        self.traced = traced
        self.ends = ends

    def release_segment(self, segment: int) -> None:
        self.ends.release_segment(segment)

    def finished(self, request: Request, status: int, bytes_out: int,
                 holder: Holder | None) -> None:
        self.ends.finished(request, status, bytes_out, holder)
        self.traced.ended(request, status, holder)


class _Keeper:
    """A sampled exchange's observer (velox.relay.exchange.Observer): keeps the start of the
    answer, and passes everything to the cache's observer when there is one."""

    __slots__ = ("inner", "pieces", "size")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pieces: list[bytes] = []
        self.size = 0

    def head(self, status: int, headers: Headers) -> None:
        if self.inner is not None:
            self.inner.head(status, headers)

    def data(self, data: bytes) -> None:
        if self.size < _KEEP_BYTES:
            self.pieces.append(bytes(data))
            self.size += len(data)
        if self.inner is not None:
            self.inner.data(data)

    def end(self, error: BaseException | None) -> None:
        if self.inner is not None:
            self.inner.end(error)

    def client_gone(self, exchange: Any) -> bool:
        return self.inner is not None and bool(self.inner.client_gone(exchange))


def _closed(live: _Live, upstream_status: int, status: int, end: int) -> None:
    """The last attempt, when still open (the one that answered), ended now. The answer's
    fields are read from what was kept in the export thread (RequestRecord.read_answer)."""
    attempts = live.attempts
    if attempts:
        last = attempts[-1]
        if not last.end_ns:  # the attempt that answered
            last.end_ns = end
            last.status = upstream_status
            if not last.status:
                last.error = "499" if status == 499 else "no_answer"


def _traceable(request: Request) -> bool:
    """Not seen before (back from the off-loop scan, its t_popped set) and not already over
    (its client left while it queued)."""
    return not request.t_popped and request.state != DONE and request.ends is not None


def _kept(live: _Live) -> list[bytes]:
    return live.keeper.pieces if live.keeper is not None else []


def _operation(path: bytes) -> str:
    for ending, operation in _OPERATIONS:
        if path.endswith(ending):
            return operation
    return ""


def install(worker: Any, settings: Any) -> Traced | None:
    """The worker's tracing, put in place; None (nothing installed) without
    VELOX_OTEL_ENDPOINT."""
    if not settings.otel_endpoint:
        return None
    traced = Traced(Tracer(settings.otel_endpoint, settings.otel_sample), worker.counters,
                    worker.slot)
    traced.install(worker)
    return traced
