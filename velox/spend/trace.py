"""OpenTelemetry traces of requests, with the GenAI semantic conventions.

Off unless VELOX_OTEL_ENDPOINT names a collector (OTLP/HTTP; spans go to `<base>/v1/traces`),
and then a worker pays on its loop only for what a sampled request needs:

* At its first attempt, `Tracer.start(traceparent)` decides whether the request is sampled:
  a client's `traceparent` (W3C Trace Context) is followed (its trace id kept, its sampled
  flag obeyed: the SDK's ParentBased sampler), else a new trace id is sampled with probability
  VELOX_OTEL_SAMPLE by the SDK's TraceIdRatioBased rule (the id's low 64 bits below
  ratio * 2**64), so every component using the same ratio keeps the same traces.
* Each upstream attempt takes a span id up front (`RequestTrace.new_span_id`) and sends
  `RequestTrace.traceparent(span_id)` upstream, so the provider's side joins the trace.
* When the request is settled, the worker (velox.spend.traced) hands `Tracer.record` a plain
  `RequestRecord` (timestamps of queueing, parsing, limits and the cache; one `AttemptSpan` per
  upstream try, retries and fallbacks included). Only a sampled record is turned into spans:
  one SERVER span for the request with an event per stage, one CLIENT span per attempt, named
  and attributed as the GenAI conventions say (`{operation} {model}`; `gen_ai.operation.name`,
  `gen_ai.provider.name` (which replaced `gen_ai.system`), `gen_ai.request.model`,
  `gen_ai.response.model`,
  `gen_ai.usage.input_tokens` / `output_tokens`, `gen_ai.response.finish_reasons`,
  `server.address` / `server.port`, `error.type`, HTTP status codes).

Spans carry the ids chosen during the request (an SDK `Tracer` would pick its own ids, and a
span made after the fact must carry the ids sent upstream). `record` queues one entry per span
(`Pending`: the record, the attempt) in the SDK's `BatchSpanProcessor`; its thread hands a
batch to the exporter, and only there are the spans made (`server_span`, `client_span`: the
answer's fields read from what was kept) and encoded by velox.spend.otlp into the bytes the
SDK's encoder would make, which the official OTLP/HTTP exporter sends (an exporter of another
kind gets the SDK's `ReadableSpan`s). The loop pays a few us per sampled request, the thread
about 12 us per span (benches/bench_trace.py); the SDK's `OTEL_BSP_*` and
`OTEL_EXPORTER_OTLP_*` settings (schedule delay, queue size, timeout, headers) apply as usual.

A dead or silent collector costs no request anything: `record` only appends to the processor's
queue. At most `max_queue` spans wait (sent or not); past that `record` drops the request's
spans and counts them (`stats()["dropped"]`), and spans whose export failed are counted too
(`failed`). Memory stays bounded; `close` waits at most its timeout.

Prompts and completions are never recorded: a record has no field for them, and no setting asks
for them in this version.

The SDK is an optional extra (`pip install 'velox[otel]'`); it is imported when a Tracer is
made, never by a gateway without VELOX_OTEL_ENDPOINT.
"""

from __future__ import annotations

import math
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import orjson

from velox.spend.otlp import CLIENT, SERVER, Encoder, SpanData

TRACES_PATH = "/v1/traces"
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_LOW64 = (1 << 64) - 1
# An event stream's fields, found without parsing each event (OpenAI's and Anthropic's names).
_FINISH = re.compile(rb'"(?:finish|stop)_reason"\s*:\s*"([^"]+)"')
_MODEL = re.compile(rb'"model"\s*:\s*"([^"]+)"')
_IN = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_OUT = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
# next_sampled at ratio 0: no request is ever sampled (a countdown that never ends).
NEVER = 1 << 62
CLOSE_TIMEOUT_S = 3.0
SCOPE = "velox"
# Provider names of the GenAI conventions, by upstream kind (velox.config.tables UPSTREAM_KINDS and
# the provider translators' kinds).
PROVIDERS = {"openai": "openai", "azure": "azure.ai.openai", "anthropic": "anthropic",
             "gemini": "gcp.gemini", "bedrock": "aws.bedrock"}


class TraceParent(NamedTuple):
    trace_id: int
    span_id: int
    sampled: bool


def parse_traceparent(value: bytes | str | None) -> TraceParent | None:
    """A W3C `traceparent` header, or None when absent or invalid (then a new trace starts).

    Version 00 exactly as the spec says; a higher version is read for its first four fields
    (the spec's forward compatibility); all-zero ids and version ff are invalid."""
    if not value:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    text = text.strip().lower()
    match = _TRACEPARENT.match(text)
    if match is None:
        return None
    version, trace_hex, span_hex, flags = match.groups()
    if version == "ff" or (version == "00" and len(text) != 55):
        return None
    if version != "00" and len(text) > 55 and text[55] != "-":
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return TraceParent(trace_id, span_id, bool(int(flags, 16) & 1))


def format_traceparent(trace_id: int, span_id: int, sampled: bool) -> bytes:
    return b"00-%032x-%016x-%s" % (trace_id, span_id, b"01" if sampled else b"00")


@dataclass(slots=True)
class RequestTrace:
    """A request's place in its trace, decided at admission (`Tracer.start`)."""

    trace_id: int
    span_id: int  # the request's SERVER span
    parent_span_id: int  # the client's span (0: none, the request starts the trace)
    sampled: bool

    def new_span_id(self) -> int:
        """An id for one upstream attempt's CLIENT span (choose it before sending)."""
        return random.getrandbits(64) or 1

    def traceparent(self, attempt_span_id: int) -> bytes:
        """The `traceparent` to send upstream for the attempt with this span id."""
        return format_traceparent(self.trace_id, attempt_span_id, self.sampled)


@dataclass(slots=True)
class AttemptSpan:
    """One try of one upstream (times: time.perf_counter_ns)."""

    span_id: int
    upstream: str  # the [[upstream]] name
    kind: str  # its kind: openai, azure, anthropic, ...
    address: str  # host
    port: int
    model: str  # the model sent upstream
    start_ns: int
    end_ns: int
    status: int = 0  # the upstream's HTTP status; 0: none (connect error, timeout)
    error: str = ""  # error.type when it failed: "timeout", "connect", "500", ...
    response_model: str = ""
    finish_reasons: Sequence[str] = ()
    input_tokens: int | None = None
    output_tokens: int | None = None


@dataclass(slots=True)
class RequestRecord:
    """A settled request as the pipeline saw it (times: time.perf_counter_ns; 0: did not
    happen). The tracer reads it after the answer went out."""

    trace: RequestTrace
    operation: str  # gen_ai.operation.name: chat, embeddings, text_completion, ...
    method: str
    path: str  # without the query string
    model: str  # the model the client named
    status: int
    start_ns: int  # the request's first byte
    end_ns: int  # the answer's last byte
    queued_ns: int = 0
    parsed_ns: int = 0
    limits_ns: int = 0
    cache_ns: int = 0
    cache_hit: bool | None = None
    key: str = ""
    route: str = ""
    response_model: str = ""
    finish_reasons: Sequence[str] = ()
    input_tokens: int | None = None
    output_tokens: int | None = None
    cost_nanos: int | None = None
    error: str = ""  # error.type of the answer when it failed
    attempts: list[AttemptSpan] = field(default_factory=list)
    # Spans of other traces this one's spans link to (trace id, span id): a batched member's
    # server span names its merged call's client spans, and that call's spans name the
    # members' server spans.
    links: Sequence[tuple[int, int]] = ()
    # A merged batch call's members (velox.batching): a call the gateway made on behalf of
    # several requests has no SERVER span, its CLIENT spans (one per attempt) start its trace.
    # 0: a client's request.
    members: int = 0
    # The answer as the client got it (its first 256 KiB), read for the response model, finish
    # reasons and usage in the export thread (`read_answer`), not on the loop: at 1% sampling
    # a sampled request's path runs cold and its parse cost the loop tens of us.
    answer: Sequence[bytes] = ()
    # A batched member's share of the merged call's tokens, when its answer says none.
    share_tokens: tuple[int, int] | None = None

    def read_answer(self) -> None:
        """Fill the answer's fields from what was kept (once), and the answering attempt's."""
        pieces, share = self.answer, self.share_tokens
        if not pieces and share is None:
            return
        self.answer, self.share_tokens = (), None
        model, finish, tokens_in, tokens_out = answer_fields(pieces)
        if self.attempts:
            last = self.attempts[-1]
            if last.status and last.status < 400:
                last.response_model, last.finish_reasons = model, finish
                last.input_tokens, last.output_tokens = tokens_in, tokens_out
        if tokens_in is None and share is not None:
            tokens_in, tokens_out = share
        self.response_model, self.finish_reasons = model, finish
        self.input_tokens, self.output_tokens = tokens_in, tokens_out

    def span_name(self, model: str) -> str:
        """`{gen_ai.operation.name} {model}` (the GenAI conventions), else `{method} {path}`
        for a call that is not a model's (GET /v1/models, files)."""
        if self.operation:
            return f"{self.operation} {model}" if model else self.operation
        return f"{self.method} {self.path}"


def answer_fields(pieces: Sequence[bytes]) -> tuple[str, tuple[str, ...], int | None,
                                                   int | None]:
    """Response model, finish reasons, input and output tokens of an answer as kept."""
    if not pieces:
        return "", (), None, None
    body = b"".join(pieces)
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


def next_sampled(ratio: float, draw: float) -> int:
    """How many requests from now the next sampled one is (1: the next), for a `draw` in
    [0, 1): each request sampled with probability `ratio` independently of the others, so the
    gaps are geometric, `int(log(1 - draw) / log(1 - ratio)) + 1`. Requests between two
    samples then cost a countdown, not a random draw each (Traced); `NEVER` at ratio 0."""
    if ratio >= 1.0:
        return 1
    if ratio <= 0.0 or not sample_bound(ratio):
        return NEVER
    return min(int(math.log1p(-draw) / math.log1p(-ratio)) + 1, NEVER)


def sampled_trace_id(ratio: float) -> int:
    """A random trace id that TraceIdRatioBased at `ratio` samples: its low 64 bits uniform
    below the bound (a sampled id of a random draw is exactly that), the high 64 random."""
    low = random.randrange(sample_bound(ratio)) if ratio < 1.0 else random.getrandbits(64)
    return (random.getrandbits(64) << 64 | low) or 1


def is_sampled(trace_id: int, ratio: float) -> bool:
    """TraceIdRatioBased's rule, so Velox keeps the traces other samplers keep."""
    return (trace_id & _LOW64) < sample_bound(ratio)


def sample_bound(ratio: float) -> int:
    """A trace id is sampled at `ratio` when its low 64 bits are below this."""
    return round(ratio * (_LOW64 + 1))


class Tracer:
    """One per worker: the sampling decision, and records turned into exported spans."""

    def __init__(self, endpoint: str = "", sample: float = 1.0, exporter: Any = None,
                 max_queue: int | None = None, max_export_batch: int | None = None,
                 service_name: str = "velox", schedule_delay_ms: float | None = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from velox import __version__

        self.sample = sample
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + TRACES_PATH)
        self.resource = Resource.create({"service.name": service_name,
                                         "service.version": __version__,
                                         "host.name": socket.gethostname()})
        self.scope = InstrumentationScope(SCOPE, __version__)
        self.exporter = _Counting(exporter, _Spans(self.resource, self.scope))
        # Unset sizes are the SDK's (its OTEL_BSP_* variables, else 2,048 and 512); the queue
        # size is read back from the SDK so `record` can keep within it.
        defaults: Any = BatchSpanProcessor  # its default-size helpers are untyped
        if max_queue is None:
            max_queue = int(defaults._default_max_queue_size())
        if max_export_batch is None:
            max_export_batch = int(defaults._default_max_export_batch_size())
        self.max_queue = max_queue
        self.processor = BatchSpanProcessor(self.exporter,  # type: ignore[arg-type]
                                            max_queue_size=max_queue,
                                            max_export_batch_size=min(max_export_batch,
                                                                      max_queue),
                                            schedule_delay_millis=schedule_delay_ms)
        self.submitted = 0
        self.dropped = 0

    # --- on the request path ---------------------------------------------------------------

    def start(self, traceparent: bytes | str | None = None) -> RequestTrace:
        """The request's trace: the client's, or a new one sampled at VELOX_OTEL_SAMPLE (a
        worker decides that by countdown instead: velox.spend.traced, `next_sampled`)."""
        parent = parse_traceparent(traceparent)
        span_id = random.getrandbits(64) or 1
        if parent is not None:
            return RequestTrace(parent.trace_id, span_id, parent.span_id, parent.sampled)
        trace_id = random.getrandbits(128) or 1
        return RequestTrace(trace_id, span_id, 0, is_sampled(trace_id, self.sample))

    def record(self, rec: RequestRecord) -> int:
        """Export a settled request's spans if it is sampled; return how many were queued
        (0 when unsampled, or dropped because `max_queue` spans already wait).

        The spans are queued as they are described (`Pending`: the record, the attempt, the
        clock's offset) and made in the export thread: on the loop this costs a few us a
        request where building the SDK's spans cost ~26 (two spans, benches/bench_trace.py)."""
        if not rec.trace.sampled:
            return 0
        count = (not rec.members) + len(rec.attempts)
        if self.submitted - self.exporter.done + count > self.max_queue:
            self.dropped += count
            return 0
        offset = time.time_ns() - time.perf_counter_ns()
        on_end = self.processor.on_end
        if not rec.members:
            on_end(Pending(rec, None, offset))  # type: ignore[arg-type]
        for attempt in rec.attempts:
            on_end(Pending(rec, attempt, offset))  # type: ignore[arg-type]
        self.submitted += count
        return count

    # --- the rest --------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Spans queued, exported, failed to export, dropped (the queue was full), pending."""
        done = self.exporter.done
        return {"submitted": self.submitted, "exported": self.exporter.exported,
                "failed": self.exporter.failed, "dropped": self.dropped,
                "pending": self.submitted - done}

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Export what waits, for at most `timeout_s`; past that, abandon it (a dead
        collector must not hold a worker's exit)."""
        closer = threading.Thread(target=self.processor.shutdown, name="velox-otel-close",
                                  daemon=True)
        closer.start()
        closer.join(timeout_s)
        if closer.is_alive():
            self.exporter.shutdown()  # stops the exporter's retries; the thread is a daemon


class _Sampled:
    """What the SDK's BatchSpanProcessor reads of a span before queueing it: its context's
    sampled flag (only sampled records are queued)."""

    class trace_flags:  # the SDK's attribute name
        sampled = True


class _PendingFields(NamedTuple):
    rec: RequestRecord
    attempt: AttemptSpan | None
    offset: int


class Pending(_PendingFields):
    """A span waiting in the batch processor's queue: the settled request's record, the
    attempt for a CLIENT span (None: the SERVER span), and the offset from
    time.perf_counter_ns to Unix time when it was recorded."""

    __slots__ = ()
    context = _Sampled  # the processor's look at the span (not a field)


# --- spans (in the export thread) ------------------------------------------------------------

def span_data(pending: Pending) -> SpanData:
    """The span a queued entry stands for."""
    pending.rec.read_answer()
    if pending.attempt is None:
        return server_span(pending.rec, pending.offset)
    return client_span(pending.rec, pending.attempt, pending.offset)


def server_span(rec: RequestRecord, offset: int) -> SpanData:
    """The request's SERVER span: one event per stage it went through."""
    trace = rec.trace
    attrs: dict[str, Any] = {
        "http.request.method": rec.method, "url.path": rec.path,
        "http.response.status_code": rec.status,
        "velox.attempts": len(rec.attempts),
    }
    if rec.operation:
        attrs["gen_ai.operation.name"] = rec.operation
    if rec.model:
        attrs["gen_ai.request.model"] = rec.model
    if rec.attempts:
        provider = PROVIDERS.get(rec.attempts[-1].kind, rec.attempts[-1].kind)
        attrs["gen_ai.provider.name"] = provider
    _usage_attrs(attrs, rec.response_model, rec.finish_reasons, rec.input_tokens,
                 rec.output_tokens)
    attrs.update((name, value) for name, value in (("velox.key", rec.key),
                                                   ("velox.route", rec.route)) if value)
    if rec.cost_nanos is not None:
        attrs["velox.cost_usd"] = rec.cost_nanos / 1e9
    if rec.cache_hit is not None:
        attrs["velox.cache.hit"] = rec.cache_hit
    error = rec.error or (str(rec.status) if rec.status >= 500 else "")
    if error:
        attrs["error.type"] = error
    no_attrs: dict[str, Any] = {}
    events = [(name, no_attrs, when + offset) for name, when in (
        ("velox.queued", rec.queued_ns), ("velox.parsed", rec.parsed_ns),
        ("velox.limits", rec.limits_ns)) if when]
    if rec.cache_ns:
        events.append(("velox.cache", {"velox.cache.hit": bool(rec.cache_hit)},
                       rec.cache_ns + offset))
    # HTTP server conventions: only 5xx is an error of the server span.
    return SpanData(trace.trace_id, trace.span_id, trace.parent_span_id, True,
                    rec.span_name(rec.model), SERVER, rec.start_ns + offset,
                    rec.end_ns + offset, attrs, events, rec.links,
                    rec.status >= 500 or bool(rec.error))


def client_span(rec: RequestRecord, attempt: AttemptSpan, offset: int) -> SpanData:
    """One attempt's CLIENT span: a child of the SERVER span, or, for a merged batch call
    (no SERVER span), the root of the call's trace, linked to its members."""
    provider = PROVIDERS.get(attempt.kind, attempt.kind)
    attrs: dict[str, Any] = {
        "gen_ai.provider.name": provider, "gen_ai.request.model": attempt.model,
        "server.address": attempt.address, "server.port": attempt.port,
        "velox.upstream": attempt.upstream,
    }
    if rec.operation:
        attrs["gen_ai.operation.name"] = rec.operation
    if attempt.status:
        attrs["http.response.status_code"] = attempt.status
    _usage_attrs(attrs, attempt.response_model, attempt.finish_reasons,
                 attempt.input_tokens, attempt.output_tokens)
    error = attempt.error or (str(attempt.status) if attempt.status >= 400 else "")
    if error:
        attrs["error.type"] = error
    if rec.members:  # a merged call: how many requests it carried
        attrs["velox.batch.members"] = rec.members
    return SpanData(rec.trace.trace_id, attempt.span_id,
                    0 if rec.members else rec.trace.span_id, False,
                    rec.span_name(attempt.model), CLIENT, attempt.start_ns + offset,
                    attempt.end_ns + offset, attrs, (), rec.links if rec.members else (),
                    bool(error))


def _usage_attrs(attrs: dict[str, Any], response_model: str, finish: Sequence[str],
                 tokens_in: int | None, tokens_out: int | None) -> None:
    if response_model:
        attrs["gen_ai.response.model"] = response_model
    if finish:
        attrs["gen_ai.response.finish_reasons"] = list(finish)
    if tokens_in is not None:
        attrs["gen_ai.usage.input_tokens"] = tokens_in
    if tokens_out is not None:
        attrs["gen_ai.usage.output_tokens"] = tokens_out


class _Spans:
    """Queued entries to what an exporter takes: the OTLP request's bytes (velox.spend.otlp)
    or the SDK's `ReadableSpan`s, under the tracer's resource and scope."""

    def __init__(self, resource: Any, scope: Any) -> None:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        self.resource = resource
        self.scope = scope
        self.sdk = _sdk_names()
        # The resource's and scope's messages as the SDK's encoder writes them (encoded once,
        # through a span that carries them): every request repeats them as they are.
        probe = encode_spans([self.readable(SpanData(1, 1, 0, False, "", SERVER, 0, 0, {}))])
        scope_spans = probe.resource_spans[0].scope_spans[0]
        self.encoder = Encoder(probe.resource_spans[0].resource.SerializeToString(),
                               scope_spans.scope.SerializeToString())

    def encoded(self, entries: Sequence[Pending]) -> bytes:
        return self.encoder.request([span_data(p) for p in entries])

    def readables(self, entries: Sequence[Pending]) -> list[Any]:
        return [self.readable(span_data(p)) for p in entries]

    def readable(self, s: SpanData) -> Any:
        """The SDK's span for `s` (for an exporter that is not the OTLP one, and the
        differential test of the encoder)."""
        sdk = self.sdk
        parent = sdk.SpanContext(s.trace_id, s.parent_span_id, is_remote=s.remote_parent,
                                 trace_flags=sdk.SAMPLED) if s.parent_span_id else None
        return sdk.ReadableSpan(
            s.name, context=sdk.SpanContext(s.trace_id, s.span_id, is_remote=False,
                                            trace_flags=sdk.SAMPLED),
            parent=parent, resource=self.resource, attributes=s.attributes,
            events=[sdk.Event(name, attrs, when) for name, attrs, when in s.events],
            links=[sdk.Link(sdk.SpanContext(trace, span, is_remote=False,
                                            trace_flags=sdk.SAMPLED)) for trace, span in s.links],
            kind=sdk.SERVER if s.kind == SERVER else sdk.CLIENT,
            status=sdk.Status(sdk.ERROR) if s.error else sdk.UNSET_STATUS,
            start_time=s.start_ns, end_time=s.end_ns, instrumentation_scope=self.scope)


class _Counting:
    """The real exporter, counting what it exported and what failed (done = both). Given
    queued entries (`Pending`), it hands the SDK's OTLP/HTTP exporter the request encoded by
    velox.spend.otlp, and any other exporter the SDK's spans."""

    def __init__(self, inner: Any, spans: _Spans) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.inner = inner
        self.spans = spans
        self.success = SpanExportResult.SUCCESS
        self.failure = SpanExportResult.FAILURE
        self.send = _bytes_sender(inner)
        self.closed = False
        self.exported = 0
        self.failed = 0

    @property
    def done(self) -> int:
        return self.exported + self.failed

    def export(self, entries: Sequence[Pending]) -> Any:
        try:
            if self.send is not None:
                result = self.failure if self.closed else \
                    self.success if self.send(self.spans.encoded(entries)) else self.failure
            else:
                result = self.inner.export(self.spans.readables(entries))
        except Exception:
            self.failed += len(entries)
            raise
        if result == self.success:
            self.exported += len(entries)
        else:
            self.failed += len(entries)
        return result

    def shutdown(self) -> None:
        self.closed = True
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self.inner.force_flush(timeout_millis))


def _bytes_sender(exporter: Any) -> Callable[[bytes], bool] | None:
    """How to send an encoded request through `exporter`, or None: it takes spans only.

    The SDK's OTLPSpanExporter encodes spans and hands the bytes to its HTTP client, which
    POSTs them with the exporter's settings (endpoint, OTEL_EXPORTER_OTLP_* headers, timeout,
    compression, certificates) and retries; that client is what Velox's bytes go through. It
    is the exporter's own attribute (`_client`, SDK 1.39 and later), not public API: another
    SDK without it gets its spans encoded by the SDK (slower, same bytes). An exporter of
    another kind may offer `export_encoded(bytes) -> bool` (the benchmarks' do)."""
    own = getattr(exporter, "export_encoded", None)
    if callable(own):
        return cast("Callable[[bytes], bool]", own)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    export = getattr(getattr(exporter, "_client", None), "export", None)
    if type(exporter) is not OTLPSpanExporter or not callable(export):
        return None

    def send(data: bytes) -> bool:
        return bool(export(data).success)

    return send


class _SdkNames:
    """The SDK classes and constants the span builders use, imported once."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
        from opentelemetry.trace.status import Status, StatusCode

        self.Event, self.ReadableSpan, self.SpanContext = Event, ReadableSpan, SpanContext
        self.Link = Link
        self.Status = Status
        self.SERVER, self.CLIENT = SpanKind.SERVER, SpanKind.CLIENT
        self.SAMPLED = TraceFlags(TraceFlags.SAMPLED)
        self.ERROR = StatusCode.ERROR
        self.UNSET_STATUS = Status(StatusCode.UNSET)


_SDK: _SdkNames | None = None


def _sdk_names() -> _SdkNames:
    global _SDK  # noqa: PLW0603 - imported once, on the first sampled span
    if _SDK is None:
        _SDK = _SdkNames()
    return _SDK
