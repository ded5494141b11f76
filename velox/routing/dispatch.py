"""Dispatch: send each admitted request to the upstream its route picks, and to another one
while nothing of the answer has reached the client.

Per request the worker calls `send(exchange)`. The route is the request's model
(`velox.config.tables`: its own route, else the catch-all `"*"`); a request without a model (GET
/v1/files, POST /) uses the catch-all route, else the first route of the file.
`velox.routing.balance` chooses the target (weights, least busy, affinity hash, priorities,
breakers, in-flight caps, rpm buckets, panic), and this module turns its choice into an upstream
request: the upstream's path (Azure deployment paths), its credential header, and the body with the
target's model name when it differs from the public one (the bytes of the `model` value are replaced
in place of the original, found by the native scanner; nothing else in the body is re-serialised).

Failover. The relay asks `response` when response headers arrive and `error_failed` when
an attempt fails, as long as no byte has been written to the client (the commit point; a plain
answer is collected whole before it goes out, so its headers alone do not commit it): an
upstream-caused failure that `balance.verdict_of` calls retryable (connection refused, reset or
lost, before or after the headers, TLS, connect timeout, 502/503/504/529, no headers within
the request timeout, a 429 — which moves to another target and returns to its own only after
a Retry-After of at most 2 s) is sent again, to the target the plan chooses then, within the
retry policy's attempts, elapsed time and the gateway-wide retry budget. A request whose
connection was lost may have run upstream: sending it again may pay for it twice, but its
client gets one answer instead of a 502 that the OpenAI and Anthropic SDKs retry by default
(see balance.EVENT_TABLE). The abandoned attempt is cancelled (RST_STREAM), so it
holds nothing. Past the commit point nothing is retried; the relay ends a broken event stream
with an error event instead.

Every attempt is finished exactly once (`balance.RoutePlan.finish`), whatever ends it: answered,
failed, retried, cancelled by a client that left. That releases its in-flight place and reports
its outcome to the upstream's shared breaker.

Background probes. An upstream whose breaker is open gets no requests; once its open time is
over, `probe` (called from the worker's tick) sends it the warm-up request as the breaker's
probe, so it can close again without a client request being the test.

Breaker transitions are logged once each (`log_breakers`, from the same tick): the shared
breaker moves by CAS, so exactly one worker makes each transition and keeps it (native
Health.transitions); that worker logs it with the upstream, and for an opening the route and
the failure that opened it, which it noted on its own failure paths (`_last_failure`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import orjson

from velox.config.tables import CATCH_ALL, Tables
from velox.core.clock import now_ms
from velox.core.errors import ModelNotFound, UpstreamTimeout, UpstreamUnavailable, VeloxError
from velox.core.fields import STATUS_CLASS, UPSTREAM_CLASSES, UPSTREAM_ERROR
from velox.egress.edge import Edge
from velox.ingress.scan import scan_json
from velox.providers.base import Untranslatable
from velox.routing.balance import Event, RouteAttempt, RoutePlan, Router, Verdict, verdict_of
from velox.state.health import FAILURE, NEUTRAL, SUCCESS, TR_CLOSED, TR_HALF_OPENED, TR_OPENED
from velox.state.stats import SharedStats

if TYPE_CHECKING:
    from velox.core.types import Request
    from velox.egress.interfaces import CallHandle, Egress, Headers
    from velox.relay.exchange import Exchange

log = logging.getLogger("velox.dispatch")

AFFINITY_HEADER = b"x-velox-affinity"
_RETRY_AFTER = b"retry-after"
_WIDTH = len(UPSTREAM_CLASSES)
_EXTRA_MADE = 16  # attempt numbers whose x-velox-* headers are made in advance
# velox_retries_total{reason}: stats.RETRY_REASONS positions.
_R_CONNECT, _R_TIMEOUT, _R_5XX, _R_429, _R_REFUSED, _R_PROTOCOL = range(6)


class Dispatch:
    """One worker's dispatcher over every upstream of the tables."""

    __slots__ = ("tables", "router", "upstreams", "names", "credentials", "stats", "slot",
                 "loop", "forward_model", "hashed", "probes", "edge", "tracer", "_status",
                 "_targets",
                 "_latency", "_retries", "_plain", "_extra", "_hash_all", "_last_failure")

    def __init__(self, tables: Tables, stats: SharedStats, upstreams: list[Egress], slot: int,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.tables = tables
        self.router = Router(tables, stats.health, tpm=stats.health.tpm)
        self.upstreams = upstreams  # by index in tables.upstreams
        self.names = tuple(u.name.encode() for u in tables.upstreams)
        self.credentials = tuple(u.auth_headers() for u in tables.upstreams)
        self.stats = stats
        self.slot = slot
        self.loop = loop
        catch_all = any(r.model == CATCH_ALL for r in tables.routes)
        self.forward_model = CATCH_ALL if catch_all else tables.routes[0].model
        # Routes (by public model) whose strategy needs the affinity key.
        self.hashed = frozenset(r.model for r in tables.routes if r.strategy == "hash")
        self._hash_all = CATCH_ALL in self.hashed  # the catch-all route hashes
        self.probes: set[int] = set()  # upstreams with a background probe in flight
        self._status = stats.upstream_status
        self._targets = stats.targets
        # Upstreams whose path is the client's as it is (not azure): no call per request.
        self._plain = tuple(u.kind != "azure" for u in tables.upstreams)
        # Upstreams of another API than OpenAI's: each attempt translated (velox.egress.edge).
        self.edge = Edge(tables.upstreams)
        # Traces (velox.spend.traced, VELOX_OTEL_ENDPOINT): told of each failed attempt; None
        # without tracing (tested on failure paths only).
        self.tracer: Any = None
        # The answer's x-velox-upstream and x-velox-attempts, made once per upstream and number.
        self._extra = tuple(tuple(head_extra(name, n) for n in range(_EXTRA_MADE))
                            for name in self.names)
        self._latency = stats.upstream_latency
        self._retries = stats.retries
        # Upstream -> (route, what failed) of the last failure this worker saw: the reason a
        # breaker opening this worker made is logged with (written on failure paths only).
        self._last_failure: dict[int, tuple[str, str]] = {}

    # --- the first attempt --------------------------------------------------------------------

    def send(self, exchange: Exchange) -> None:
        """Choose the first target of an admitted request and hand it to that upstream."""
        request = exchange.request
        model = request.model
        key = None
        if model is None:
            model = self.forward_model
        elif model in self.hashed or (self._hash_all and self.router.chains.get(model) is None):
            key = affinity(request)
        plan = self.router.plan(model, key, request.allowed)
        if plan is None:
            exchange.refuse(ModelNotFound(
                f"The model `{model}` does not exist or you do not have access to it.",
                param="model"))
            return
        meter = exchange.meter
        if meter is not None and self.router.tpm is not None:
            plan.tokens = meter.estimate  # reserved on the tpm bucket of the upstream chosen
        attempt = plan.first()
        if isinstance(attempt, VeloxError):
            exchange.refuse(attempt)
            return
        exchange.routing = plan
        self._submit(exchange, plan, attempt)

    def _submit(self, exchange: Exchange, plan: RoutePlan, attempt: RouteAttempt) -> None:
        request = exchange.request
        u = attempt.upstream
        plan.attempt = attempt
        plan.attempts = n = attempt.number
        plan.upstream_name = self.names[u]
        plan.outcome = NEUTRAL
        exchange.extra = self._extra[u][n] if n < _EXTRA_MADE else head_extra(self.names[u], n)
        translator = self.edge.translators[u]
        if translator is not None and not exchange.front:
            self._submit_translated(exchange, attempt)
            return
        # The Messages API in front (exchange.target): an anthropic upstream takes the request
        # as it is; gemini and bedrock get it through chat completions and their translator.
        if exchange.edge is not None:  # an earlier attempt was translated
            exchange.edge = None
            exchange.method = request.method
        exchange.path = request.upstream_path if self._plain[u] else \
            self.tables.upstreams[u].upstream_path(request.upstream_path, attempt.model)
        # The upstream's own credential; without one, the client's (passed through only when
        # the gateway has no keys of its own: auth.Auth decided that in `passthrough`).
        exchange.headers_out = exchange.headers_base + (self.credentials[u]
                                                        or exchange.passthrough)
        body = request.body if request.model is None or attempt.model == request.model \
            else rewrite_model(request.body, attempt.model, request.model_span)
        meter = exchange.meter
        # A stream whose usage the gateway asks for itself (velox.relay.usage), where the upstream
        # accepts the option; the meter then strips what it brings.
        exchange.body = body if meter is None else \
            meter.for_attempt(body, self.tables.upstreams[u].stream_usage)
        # The Anthropic Messages API in front (velox.relay.messages): shaped for this target,
        # or answered by the gateway itself (False).
        if exchange.front and not exchange.target(self.tables.upstreams[u], attempt.model,
                                                  self.credentials[u], translator):
            return
        if attempt.index >= 0:
            self._targets.add(self.slot, attempt.index, 1)
        self.upstreams[u].submit(exchange, attempt.number - 1)

    def _submit_translated(self, exchange: Exchange, attempt: RouteAttempt) -> None:
        """_submit for an upstream of another API: the call in its API, or a 400 before
        anything is sent when the request cannot be expressed there."""
        u = attempt.upstream
        try:
            edge = self.edge.attempt(u, exchange.request, attempt.model, exchange.meter,
                                     attempt.route.default_max_tokens)
        except Untranslatable as exc:
            exchange.refuse(exc)  # finishes the route attempt (finish) without an outcome
            return
        call = edge.call
        exchange.edge = edge
        exchange.method = call.method
        exchange.path = call.path
        exchange.headers_out = call.headers  # the kind's credential; none of the client's
        exchange.body = call.body
        if attempt.index >= 0:
            self._targets.add(self.slot, attempt.index, 1)
        self.upstreams[u].submit(exchange, attempt.number - 1)

    # --- before the commit point --------------------------------------------------------------

    def response(self, exchange: Exchange, status: int, headers: Headers) -> bool:
        """Response headers arrived (before the commit point): True when the request is being
        sent again instead of answered with them."""
        plan: RoutePlan = exchange.routing  # type: ignore[assignment]  # send's (attempt set)
        attempt = plan.attempt
        if attempt is None:
            return False
        if 100 <= status < 500 and status != 429:  # the upstream works (a 4xx is the client's)
            # _count_status, inlined: this runs once per answer
            self._status.add(self.slot, attempt.upstream * _WIDTH + STATUS_CLASS[status // 100],
                             1)
            plan.outcome = SUCCESS
            return False
        self._count_status(attempt.upstream, status)
        if self.tracer is not None:
            self.tracer.attempt_failed(exchange, status, "")
        if status < 500 and status != 429:
            plan.outcome = SUCCESS
            return False
        self._last_failure[attempt.upstream] = (attempt.route.model, f"HTTP {status}")
        retry_after = _retry_after(headers) if status == 429 else None
        verdict = verdict_of(Event.RESPONSE, status, retry_after, self.tables.retry)
        plan.outcome = verdict.outcome
        if not verdict.retryable:
            return False
        return self._again(exchange, plan, attempt, verdict,
                           _R_429 if status == 429 else _R_5XX)

    def error_failed(self, exchange: Exchange, exc: BaseException) -> bool:
        """The attempt failed before anything reached the client: True when sent again."""
        plan: RoutePlan = exchange.routing  # type: ignore[assignment]  # send's (attempt set)
        attempt = plan.attempt
        if attempt is None:
            return False
        self._count_status(attempt.upstream, 0)
        self._last_failure[attempt.upstream] = (attempt.route.model, str(exc))
        if self.tracer is not None:
            self.tracer.attempt_failed(exchange, exchange.status, type(exc).__name__)
        event, reason = _event_of(exc, exchange.status != 0)
        verdict = verdict_of(event)
        plan.outcome = verdict.outcome
        if not verdict.retryable:
            return False
        return self._again(exchange, plan, attempt, verdict, reason)

    def _again(self, exchange: Exchange, plan: RoutePlan, attempt: RouteAttempt,
               verdict: Verdict, reason: int) -> bool:
        nxt = plan.retry(attempt, verdict)  # finishes `attempt` with the verdict's outcome
        if nxt is None:
            plan.attempt = None  # finished: the answer goes out as it is
            return False
        self._retries.add(self.slot, reason, 1)
        current = exchange.attempt
        if current is not None:
            current.cancel()  # RST_STREAM if the stream is still open: it holds nothing after
        exchange.reset_for_retry()
        if nxt.delay_ms:
            # The next attempt is the exchange's from now on: a client that leaves while we
            # wait out the Retry-After finishes it (relay._done → finish), releasing its place.
            plan.attempt = nxt
            self.loop.call_later(nxt.delay_ms / 1000, self._resend, exchange, plan, nxt)
        else:
            self._submit(exchange, plan, nxt)
            self.upstreams[nxt.upstream].flush()
        return True

    def _resend(self, exchange: Exchange, plan: RoutePlan, attempt: RouteAttempt) -> None:
        if exchange.finished or plan.attempt is not attempt:
            return  # the client left meanwhile: finish() already released the attempt
        self._submit(exchange, plan, attempt)
        self.upstreams[attempt.upstream].flush()

    # --- the end ------------------------------------------------------------------------------

    def finish(self, exchange: Exchange, broken: bool) -> None:
        """The exchange is over: finish its attempt (releases it, reports to the breaker)."""
        plan: RoutePlan = exchange.routing  # type: ignore[assignment]  # send's (attempt set)
        attempt = plan.attempt
        if attempt is None:
            return
        plan.attempt = None
        if broken:
            self._last_failure[attempt.upstream] = (attempt.route.model,
                                                    "the answer broke after it had started")
        outcome = FAILURE if broken else plan.outcome
        plan.finish(attempt, outcome)
        t_sent, t_headers = exchange.t_sent, exchange.t_headers
        if t_headers and t_sent:
            self._latency[attempt.upstream].record(self.slot, (t_headers - t_sent) // 1000)

    def _count_status(self, u: int, status: int) -> None:
        cls = STATUS_CLASS[status // 100] if 100 <= status < 1000 else UPSTREAM_ERROR
        self._status.add(self.slot, u * _WIDTH + cls, 1)

    # --- background probes ----------------------------------------------------------------------

    def probe(self) -> None:
        """Send the warm-up request to each upstream whose breaker would take a probe now."""
        health = self.stats.health
        now = now_ms()
        for u in health.needs_probe(now):
            if u in self.probes:
                continue
            probe_slot = health.allow(u, now)
            if probe_slot < 0:
                continue  # another worker's probe holds the slot
            self.probes.add(u)
            spec = self.tables.upstreams[u]
            probe = Probe(self, u, probe_slot, spec.warmup_path.encode(), self.credentials[u])
            self.upstreams[u].submit(probe, 0)
            self.upstreams[u].flush()

    def probe_done(self, probe: Probe, outcome: int, why: str) -> None:
        self.probes.discard(probe.u)
        if outcome == FAILURE:  # logged as the breaker's re-opening (log_breakers)
            self._last_failure[probe.u] = ("", why)
        self.stats.health.finish(probe.u, probe.probe_slot, outcome, now_ms())

    # --- breaker transitions --------------------------------------------------------------------

    def log_breakers(self) -> None:
        """Log the breaker transitions this worker made since the last call (each transition
        is made by one worker: the line is written once for the whole gateway)."""
        events, lost = self.stats.health.transitions()
        for u, transition, _at, open_ms in events:
            name = self.tables.upstreams[u].name
            if transition == TR_HALF_OPENED:
                log.info("upstream %r: circuit breaker half-open: its open time is over, one "
                         "probe at a time decides", name)
            elif transition == TR_CLOSED:
                log.info("upstream %r: circuit breaker closed: %d probe(s) succeeded; back in "
                         "service", name, self.tables.breaker.successes)
            else:
                # "Out of service", not "no requests": a route whose every target is open
                # still sends to the one open longest (panic, velox.routing.balance).
                log.warning("upstream %r: circuit breaker %s; out of service for %g s unless "
                            "every target of a route is open", name,
                            self._opening(u, transition), open_ms / 1000)
        if lost:
            log.warning("%d circuit breaker transition(s) were made too fast to be logged", lost)

    def _opening(self, u: int, transition: int) -> str:
        """Why u's breaker opened (TR_OPENED) or opened again (TR_REOPENED), in words."""
        if transition == TR_OPENED:
            what = f"opened after {self.tables.breaker.failures} failure(s) in a row"
        else:
            what = "opened again: its probe failed"
        noted = self._last_failure.get(u)
        if noted is None:
            return what
        route, why = noted
        return f"{what} (the last: {why}; {f'route {route!r}' if route else 'background probe'})"


class Probe:
    """A breaker probe: the upstream's warm-up request, as an egress client of its own."""

    __slots__ = ("dispatch", "u", "probe_slot", "path", "headers_out", "attempt", "done")

    method = b"GET"
    body = b""
    paused = False

    def __init__(self, dispatch: Dispatch, u: int, probe_slot: int, path: bytes,
                 headers: Headers) -> None:
        self.dispatch = dispatch
        self.u = u
        self.probe_slot = probe_slot
        self.path = path
        self.headers_out = list(headers)
        self.attempt: CallHandle | None = None
        self.done = False

    def _end(self, status: int, why: str = "") -> None:
        if not self.done:
            self.done = True
            failed = status == 0 or status >= 500 or status == 429
            self.dispatch.probe_done(self, FAILURE if failed else SUCCESS,
                                     why or f"HTTP {status}")

    def on_response(self, status: int, headers: Headers, end_stream: bool) -> None:
        self._end(status)
        if not end_stream and self.attempt is not None:
            self.attempt.cancel()  # only the status matters

    def on_data(self, data: bytes, end_stream: bool) -> None:
        pass

    def on_answer(self, status: int, headers: Headers, body: bytes) -> None:
        self._end(status)

    def on_error(self, exc: BaseException) -> None:
        self._end(0, str(exc) or type(exc).__name__)


# --- helpers ------------------------------------------------------------------------------------


def affinity(request: Request) -> bytes | None:
    """The request's affinity key: the x-velox-affinity header, else the body's
    prompt_cache_key, else its user (both read by the parse stage)."""
    for name, value in request.headers:
        if name == AFFINITY_HEADER:
            return value
    key = request.affinity
    return key.encode() if key else None


def head_extra(upstream_name: bytes, attempts: int) -> tuple[tuple[bytes, bytes], ...]:
    """The headers the relay adds to an answer (Exchange.extra): the upstream that answered
    and how many attempts it took."""
    return ((b"x-velox-upstream", upstream_name), (b"x-velox-attempts", b"%d" % attempts))


def rewrite_model(body: Any, model: str, span: tuple[int, int] | None = None) -> bytes:
    """The body with its top-level `model` value replaced (the rest byte for byte); `span`:
    a multipart form's model value (parse.form_model), replaced by the name as it is."""
    if span is not None:
        return b"".join((body[:span[0]], model.encode(), body[span[1]:]))
    error, _offset, start, end, *_ = scan_json(body)
    if error or start < 0:
        return bytes(body)  # unreachable for a body the parse stage accepted
    return b"".join((body[:start], orjson.dumps(model), body[end:]))


def _retry_after(headers: Headers) -> float | None:
    for name, value in headers:
        if name == _RETRY_AFTER:
            try:
                return max(0.0, float(value))
            except ValueError:
                return None  # an HTTP date: treat as long
    return None


def _event_of(exc: BaseException, got_headers: bool) -> tuple[Event, int]:
    """What an egress failure was, for verdict_of, and its retry reason."""
    if isinstance(exc, UpstreamUnavailable):  # the connection was lost (the stream was not)
        return (Event.LOST_AFTER_HEADERS if got_headers else Event.CONNECT_RESET), _R_CONNECT
    if got_headers:
        return Event.BROKEN_AFTER_HEADERS, _R_PROTOCOL
    if isinstance(exc, UpstreamTimeout):
        return Event.HEADERS_TIMEOUT, _R_TIMEOUT
    if isinstance(exc, VeloxError) and exc.source.value == "internal":
        return Event.GATEWAY_REFUSED, _R_REFUSED
    return Event.PROTOCOL_ERROR, _R_PROTOCOL
