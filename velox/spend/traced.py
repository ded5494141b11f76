"""Traces wired into one worker (VELOX_OTEL_ENDPOINT): what velox.spend.trace needs from the
request path, put in place by `Traced.install` only when tracing is on. A gateway without it
runs none of this: no stage, no wrapper, no per-request state (the worker tests one attribute,
at build and on its tick).

When on, these hooks, each taking the place of a call the worker makes anyway:

* every upstream of the dispatcher is wrapped (`_TracedUpstream.submit`): a request's trace is
  decided at its first attempt (a client's `traceparent` followed, else sampled at
  VELOX_OTEL_SAMPLE), each attempt gets its own span id and sends `traceparent` naming it,
  sampled or not (its flags say which), and a sampled attempt is noted with its start;
* dispatch's failure paths tell `attempt_failed` the status or error of an attempt that is
  retried or answered as it failed;
* with a cache, a stage after it notes when a request left it (a miss); one answered without
  reaching that stage or any upstream was the cache's (a hit, or coalesced);
* a merged batch call (velox.batching) gets a trace of its own when any of its members is
  sampled: a CLIENT span per attempt, made when its exchange ends, linked to the members'
  SERVER spans, which link back to it;
* the worker's `finished` is wrapped: once the request is counted and logged, its record is
  built from the timestamps it carries and handed to the tracer, which turns only a sampled
  one into spans (queued in memory for the exporter's thread).

A sampled request's exchange also gets an observer (wrapping the cache's, if any) keeping the
first 256 KiB of its answer as the client gets it, to read the response model, finish reasons
and usage from at the end. Contents are never recorded: only those fields are read from it.
"""

from __future__ import annotations

import logging
import re
import time
from binascii import hexlify as _hexlify
from random import getrandbits
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson

from velox.batching.batch import BatchCall
from velox.cache.wait import Waiting
from velox.core.fields import F
from velox.relay.exchange import Exchange
from velox.spend.trace import AttemptSpan, RequestRecord, RequestTrace, Tracer, sample_bound

if TYPE_CHECKING:
    from velox.config.tables import UpstreamSpec
    from velox.core.types import Headers, Holder, Request

log = logging.getLogger("velox.trace")

TRACEPARENT = b"traceparent"
_LOW64 = (1 << 64) - 1
# What the observer keeps of a sampled answer: a chat answer's fields of interest are in its
# first bytes (model) and last (finish reason, usage); 256 KiB holds any non-streamed answer
# but a huge one, whose fields are then read from what was kept.
_KEEP_BYTES = 256 * 1024
# gen_ai.operation.name by the path's ending (OpenAI's paths, Azure's deployment paths, the
# Messages API).
_OPERATIONS = ((b"/chat/completions", "chat"), (b"/embeddings", "embeddings"),
               (b"/completions", "text_completion"), (b"/messages", "chat"),
               (b"/responses", "chat"))
# An event stream's fields, found without parsing each event (OpenAI's and Anthropic's names).
_FINISH = re.compile(rb'"(?:finish|stop)_reason"\s*:\s*"([^"]+)"')
_MODEL = re.compile(rb'"model"\s*:\s*"([^"]+)"')
_IN = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_OUT = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')


class _Live:
    """One request's trace while it runs: its attempts (sampled only) and what it kept.

    The common unsampled request (no traceparent of its client's) has none: its entry in
    `Traced.live` is its first attempt's traceparent, whose first 36 bytes (`00-{trace id}-`)
    are all a retry needs (an object and its ids cost ~1.5 us a request more; measured with
    bench_trace.py)."""

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
        # By id(request), from its first attempt to its end: a _Live, or the traceparent's
        # start of an unsampled request without a client's traceparent.
        self.live: dict[int, _Live | bytes] = {}
        self.bound = sample_bound(tracer.sample)
        self.cached = False
        self._finished: Any = None
        self._counted = (0, 0)  # exported, dropped: already added to the shared counters
        self._failed_once = False
        # request.key -> the key's name (the worker publishes a longer tuple as run-time keys
        # are made: Worker.publish_key_names).
        self.key_names: tuple[str, ...] = ()

    def install(self, worker: Any) -> None:
        """Put the hooks in place (at build, after the worker's stages and dispatch exist)."""
        dispatch = worker.dispatch
        dispatch.upstreams = [_TracedUpstream(self, u, spec) for u, spec in
                              zip(dispatch.upstreams, worker.tables.upstreams, strict=True)]
        dispatch.tracer = self
        if any(name == "cache" for name, _ in worker.stages):
            self.cached = True
            worker.add_stage("traced-cache", self._after_cache, "limit")
        self._finished = worker.finished
        worker.finished = self.finished  # the instance attribute shadows the method
        self.key_names = tuple(k.name for k in worker.tables.keys)
        worker.add_key_name_reader(self)

    # --- the request path --------------------------------------------------------------------

    def _begin(self, request: Request) -> _Live | bytes:
        """The request's trace, decided at its first attempt (or its end). An unsampled one
        without a client's traceparent is the traceparent of its first attempt, made from one
        random draw (trace id and span id) in one C call: `%x` formatting of each id cost
        ~0.3 us more (timeit on this 2-core host)."""
        traceparent = request.traceparent  # ingress noted it while reading the head
        if traceparent is None:  # most requests have none
            ids = getrandbits(192)  # the trace id's 128 bits, then the span id's 64
            if (ids >> 64) & _LOW64 >= self.bound:  # unsampled (Tracer.start's rule, in line)
                if not (ids & _LOW64 and ids >> 64):  # all-zero ids are invalid (1 in 2**64)
                    ids |= 1 | 1 << 64
                value = b"00-" + _hexlify(ids.to_bytes(24, "big"), b"-", -16) + b"-00"
                self.live[id(request)] = value
                return value
            live = _Live(RequestTrace(ids >> 64, getrandbits(64) or 1, 0, True), False)
        else:
            live = _Live(self.tracer.start(traceparent), True)
        self.live[id(request)] = live
        return live

    def _after_cache(self, requests: list[Request]) -> list[Request]:
        now = time.perf_counter_ns()
        live = self.live
        for request in requests:
            if request.ends is not None:
                entry = live.get(id(request)) or self._begin(request)
                if type(entry) is _Live:  # unsampled: no span to put the event in
                    entry.cache_ns = now
        return requests

    def attempt(self, exchange: Any, live: _Live, up: _TracedUpstream) -> None:
        """An attempt of a request with a _Live is about to be sent: its traceparent, and its
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

    def batch_attempt(self, exchange: Any, request: Request, live: _Live | bytes | None,
                      up: _TracedUpstream) -> None:
        """An attempt of a merged batch call (velox.batching.batch.BatchCall) is about to be
        sent. The call has a trace of its own, sampled when any member is: its CLIENT spans
        (one per attempt) link to the sampled members' SERVER spans, and those link back."""
        members = request.conn.members  # type: ignore[attr-defined]  # a BatchCall
        if live is None:
            sampled = []
            for member in members:
                if member.live:
                    entry = self.live.get(id(member.request)) or self._begin(member.request)
                    if type(entry) is _Live and entry.trace.sampled:
                        sampled.append(entry)
            trace_id = getrandbits(128) or 1
            live = self.live[id(request)] = _Live(RequestTrace(trace_id, 0, 0, bool(sampled)),
                                                  False)
            live.links = [(e.trace.trace_id, e.trace.span_id) for e in sampled]
            # Its spans are made, and its entry dropped, when the call ends (its exchange's
            # on_done; no `finished` ends a call of the gateway's own).
            on_done = exchange.on_done
            exchange.on_done = lambda ex, status: self._batch_done(ex, status, on_done)
        elif type(live) is not _Live:
            return
        self.attempt(exchange, live, up)
        if live.attempts:  # each sampled member links to this attempt's span
            link = (live.trace.trace_id, live.attempts[-1].span_id)
            for member in members:
                own = self.live.get(id(member.request))
                if type(own) is _Live and own.trace.sampled:
                    own.links.append(link)

    def _batch_done(self, exchange: Any, status: int, on_done: Any) -> None:
        """A merged call is over: its spans when sampled, then the call's own end."""
        request = exchange.request
        live = self.live.pop(id(request), None)
        if type(live) is _Live and live.trace.sampled:
            try:
                self.tracer.record(self._call_record(request, exchange, status, live))
            except Exception:  # a tracing bug costs spans, never the worker
                self._failed(log)
        on_done(exchange, status)

    def attempt_failed(self, exchange: Any, status: int, error: str) -> None:
        """The current attempt failed (dispatch: before it is retried, or answered as is)."""
        live = self.live.get(id(exchange.request))
        if type(live) is _Live and live.attempts:
            attempt = live.attempts[-1]
            attempt.end_ns = time.perf_counter_ns()
            attempt.status = status
            attempt.error = error or str(status)

    def finished(self, request: Request, status: int, bytes_out: int,
                 holder: Holder | None) -> None:
        """Worker.finished, then the request's spans when it is sampled."""
        self._finished(request, status, bytes_out, holder)
        live = self.live.pop(id(request), None)
        if live is None:  # never sent upstream (refused, answered by the gateway or the cache)
            if request.ends is None or not request.t_popped:
                return  # not through the pipeline: a health check, a refusal at ingress
            live = self._begin(request)
            del self.live[id(request)]
        if type(live) is not _Live or not live.trace.sampled:
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
        model, finish, tokens_in, tokens_out = _closed(
            live, holder.status if isinstance(holder, Exchange) else 0, status, end)
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
        if live.links and tokens_in is None and meter is not None:  # a batched member's share
            tokens_in, tokens_out = meter.input, meter.output
        key, names = request.key, self.key_names
        return RequestRecord(
            live.trace, _operation(path), request.method.decode("latin-1"),
            path.decode("latin-1"), request.model or "", status, request.t_received, end,
            queued_ns=request.t_popped, parsed_ns=request.t_parsed,
            limits_ns=request.t_admitted, cache_ns=cache_ns, cache_hit=cache_hit,
            response_model=model, finish_reasons=finish, input_tokens=tokens_in,
            output_tokens=tokens_out, attempts=attempts, links=live.links,
            key=names[key] if 0 <= key < len(names) else "",
            route=route_attempt.route.model if route_attempt is not None else "",
            cost_nanos=cost if type(cost) is int else None)

    def _call_record(self, request: Request, exchange: Any, status: int,
                     live: _Live) -> RequestRecord:
        """A merged batch call's record: its attempts, linked to its sampled members."""
        end = time.perf_counter_ns()
        path = request.path.partition(b"?")[0]
        model, finish, tokens_in, tokens_out = _closed(live, exchange.status, status, end)
        return RequestRecord(
            live.trace, _operation(path), request.method.decode("latin-1"),
            path.decode("latin-1"), request.model or "", status, request.t_received, end,
            response_model=model, finish_reasons=finish, input_tokens=tokens_in,
            output_tokens=tokens_out, attempts=live.attempts, links=live.links,
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
        if request is not None and request.ends is not None:  # None: a test's own request
            traced = self.traced
            live = traced.live.get(id(request))
            if type(request.conn) is BatchCall:  # a merged batch call: no client's request
                traced.batch_attempt(client, request, live, self)
            elif live is None:
                live = traced._begin(request)
                if isinstance(live, bytes):
                    # Unsampled, its first attempt: the traceparent _begin made. The headers
                    # are this attempt's own list (dispatch builds one per attempt), but a
                    # translated attempt's may be its upstream's: copied then.
                    if client.edge is None:
                        client.headers_out.append((TRACEPARENT, live))
                    else:
                        client.headers_out = [*client.headers_out, (TRACEPARENT, live)]
                else:
                    traced.attempt(client, live, self)
            elif isinstance(live, bytes):  # unsampled, tried again: the same trace, a new span
                client.headers_out = [*client.headers_out, (
                    TRACEPARENT, live[:36] + b"%016x-00" % (getrandbits(64) or 1))]
            else:
                traced.attempt(client, live, self)
        self.inner.submit(client, number)

    def flush(self) -> None:
        self.inner.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


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


def _closed(live: _Live, upstream_status: int, status: int,
            end: int) -> tuple[str, tuple[str, ...], int | None, int | None]:
    """The answer's fields (`_answer_fields`); the last attempt, when still open (the one that
    answered), ended now with them."""
    fields = _answer_fields(live.keeper)
    attempts = live.attempts
    if attempts:
        last = attempts[-1]
        if not last.end_ns:  # the attempt that answered
            last.end_ns = end
            last.status = upstream_status
            if not last.status:
                last.error = "499" if status == 499 else "no_answer"
        if last.status and last.status < 400:
            last.response_model, last.finish_reasons = fields[0], fields[1]
            last.input_tokens, last.output_tokens = fields[2], fields[3]
    return fields


def _operation(path: bytes) -> str:
    for ending, operation in _OPERATIONS:
        if path.endswith(ending):
            return operation
    return ""


def _answer_fields(keeper: _Keeper | None) -> tuple[str, tuple[str, ...], int | None,
                                                     int | None]:
    """Response model, finish reasons, input and output tokens of the answer kept."""
    if keeper is None or not keeper.pieces:
        return "", (), None, None
    body = b"".join(keeper.pieces)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:  # an event stream (or a cut answer): scan it
        return _scanned_fields(body)
    if not isinstance(doc, dict):
        return "", (), None, None
    choices = doc.get("choices")
    finish = tuple(str(c["finish_reason"]) for c in choices if isinstance(c, dict)
                   and c.get("finish_reason")) if isinstance(choices, list) else ()
    if not finish and doc.get("stop_reason"):  # the Messages API's
        finish = (str(doc["stop_reason"]),)
    usage = doc.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    tokens_in = usage.get("prompt_tokens", usage.get("input_tokens"))
    tokens_out = usage.get("completion_tokens", usage.get("output_tokens"))
    model = doc.get("model")
    return (model if isinstance(model, str) else "", finish,
            tokens_in if isinstance(tokens_in, int) else None,
            tokens_out if isinstance(tokens_out, int) else None)


def _scanned_fields(body: bytes) -> tuple[str, tuple[str, ...], int | None, int | None]:
    model = _MODEL.search(body)
    finish = tuple(dict.fromkeys(m.decode("latin-1") for m in _FINISH.findall(body)))
    tokens_in, tokens_out = _IN.findall(body), _OUT.findall(body)
    return (model.group(1).decode("latin-1") if model else "", finish,
            int(tokens_in[-1]) if tokens_in else None,
            int(tokens_out[-1]) if tokens_out else None)


def install(worker: Any, settings: Any) -> Traced | None:
    """The worker's tracing, put in place; None (nothing installed) without
    VELOX_OTEL_ENDPOINT."""
    if not settings.otel_endpoint:
        return None
    traced = Traced(Tracer(settings.otel_endpoint, settings.otel_sample), worker.counters,
                    worker.slot)
    traced.install(worker)
    return traced
