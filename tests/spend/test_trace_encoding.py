"""The hand-written OTLP encoding (velox/spend/otlp.py) against the official SDK's encoder: for
records of settled requests drawn by hypothesis (client's parent or none, retries, failures,
cache hits, merged batch calls with links, unicode, extreme numbers), the bytes Velox sends are
the bytes the SDK's `encode_spans` makes of the same spans built as its ReadableSpans; so are
arbitrary attribute maps of the kinds Velox writes. Also: the SDK's OTLP/HTTP exporter gets the
encoded bytes (not spans), any other exporter gets the SDK's spans, and the attribute cache
stays bounded."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SpanExportResult

from velox.spend import otlp
from velox.spend.otlp import SpanData
from velox.spend.trace import (
    PROVIDERS,
    AttemptSpan,
    Pending,
    RequestRecord,
    RequestTrace,
    Tracer,
    span_data,
)

U64 = st.integers(1, (1 << 64) - 1)
TIME = st.integers(0, (1 << 62))
# Text as requests carry it: any character but lone surrogates (not valid UTF-8 to either).
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
WORD = st.sampled_from(["", "gpt-4o", "claude-sonnet-4", "émoji-🙂", "x" * 200])
TOKENS = st.none() | st.integers(0, (1 << 63) - 1)
FINISH = st.lists(st.sampled_from(["stop", "length", "tool_calls", "end_turn"]), max_size=3)


class _NoExport:
    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


@pytest.fixture(scope="module")
def tracer() -> Iterator[Tracer]:
    t = Tracer(exporter=_NoExport(), schedule_delay_ms=3_600_000)
    yield t
    t.close(timeout_s=5)


@st.composite
def attempts(draw: st.DrawFn) -> AttemptSpan:
    status = draw(st.sampled_from([0, 200, 429, 500, 503]))
    return AttemptSpan(
        draw(U64), draw(WORD), draw(st.sampled_from([*PROVIDERS, "custom"])), draw(WORD),
        draw(st.integers(1, 65535)), draw(WORD), draw(TIME), draw(TIME), status=status,
        error=draw(st.sampled_from(["", "connect", "timeout", "ConnectionResetError"])),
        response_model=draw(WORD), finish_reasons=tuple(draw(FINISH)),
        input_tokens=draw(TOKENS), output_tokens=draw(TOKENS))


@st.composite
def records(draw: st.DrawFn) -> RequestRecord:
    parent = draw(st.sampled_from([0, 0x00F067AA0BA902B7]))
    members = draw(st.sampled_from([0, 0, 3]))
    trace = RequestTrace(draw(st.integers(1, (1 << 128) - 1)), 0 if members else draw(U64),
                         0 if members else parent, True)
    return RequestRecord(
        trace, draw(st.sampled_from(["", "chat", "embeddings"])), "POST", draw(TEXT),
        draw(WORD), draw(st.sampled_from([200, 400, 429, 499, 502])), draw(TIME), draw(TIME),
        queued_ns=draw(st.sampled_from([0, 5_000])), parsed_ns=draw(st.sampled_from([0, 9])),
        limits_ns=draw(st.sampled_from([0, 12_000])), cache_ns=draw(st.sampled_from([0, 7])),
        cache_hit=draw(st.sampled_from([None, True, False])), key=draw(TEXT),
        route=draw(WORD), response_model=draw(WORD), finish_reasons=tuple(draw(FINISH)),
        input_tokens=draw(TOKENS), output_tokens=draw(TOKENS),
        cost_nanos=draw(st.none() | st.integers(0, 10**15)),
        error=draw(st.sampled_from(["", "timeout"])),
        attempts=draw(st.lists(attempts(), max_size=3)),
        links=draw(st.lists(st.tuples(st.integers(1, (1 << 128) - 1), U64), max_size=2)),
        members=members)


def _entries(rec: RequestRecord, offset: int) -> list[Pending]:
    return ([] if rec.members else [Pending(rec, None, offset)]) + \
        [Pending(rec, a, offset) for a in rec.attempts]


def _both(tracer: Tracer, entries: list[Pending]) -> tuple[bytes, bytes]:
    spans = tracer.exporter.spans
    return (spans.encoded(entries),
            encode_spans(spans.readables(entries)).SerializeToString())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recs=st.lists(records(), min_size=1, max_size=4), offset=st.integers(0, 1 << 61))
def test_a_batch_of_records_encodes_as_the_sdk_encodes_it(tracer: Tracer,
                                                          recs: list[RequestRecord],
                                                          offset: int) -> None:
    entries = [e for rec in recs for e in _entries(rec, offset)]
    if not entries:  # a merged call without attempts has no span
        return
    ours, sdk = _both(tracer, entries)
    assert ExportTraceServiceRequest.FromString(ours) == ExportTraceServiceRequest.FromString(sdk)
    assert ours == sdk


VALUES = (TEXT | st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1)
          | st.floats(allow_nan=False) | st.lists(TEXT, max_size=3))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attrs=st.dictionaries(TEXT, VALUES, max_size=6),
       event=st.dictionaries(TEXT, VALUES, max_size=3),
       parent=st.sampled_from([0, 7]), remote=st.booleans(), error=st.booleans())
def test_any_attributes_of_the_kinds_velox_writes_encode_as_the_sdk_encodes_them(
        tracer: Tracer, attrs: dict[str, Any], event: dict[str, Any], parent: int,
        remote: bool, error: bool) -> None:
    span = SpanData(3, 4, parent, remote, "n", otlp.CLIENT, 1, 2, attrs, [("e", event, 5)],
                    [(8, 9)], error)
    spans = tracer.exporter.spans
    # Twice: the second time from the attribute cache.
    for _ in range(2):
        ours = spans.encoder.request([span])
        assert ours == encode_spans([spans.readable(span)]).SerializeToString()


def test_the_attribute_cache_is_bounded_and_a_bool_is_not_an_int(tracer: Tracer) -> None:
    encoder = otlp.Encoder(b"", b"")
    for n in range(otlp._CACHE_MAX * 2 + 5):
        encoder.span(SpanData(1, 2, 0, False, "n", otlp.SERVER, 0, 0, {"k": n}))
        assert len(encoder._attrs) <= otlp._CACHE_MAX
    spans = tracer.exporter.spans
    for value in (1, True, 0, False, 1.0):  # equal as dict keys, not as attributes
        span = SpanData(1, 2, 0, False, "n", otlp.SERVER, 0, 0, {"k": value})
        assert spans.encoder.request([span]) == \
            encode_spans([spans.readable(span)]).SerializeToString()


def test_the_sdk_s_otlp_exporter_is_sent_the_encoded_bytes_others_get_spans() -> None:
    """If an SDK release drops the exporter's HTTP client, this fails: tracing would still work
    through the SDK's own encoder, at several times the cost per span."""
    sent: list[bytes] = []
    exporter = OTLPSpanExporter(endpoint="http://127.0.0.1:9/v1/traces")
    t = Tracer(exporter=exporter, schedule_delay_ms=3_600_000)
    try:
        assert t.exporter.send is not None
        t.exporter.send = lambda data: sent.append(data) or True  # no collector here
        rec = RequestRecord(RequestTrace(5, 6, 0, True), "chat", "POST", "/v1/chat/completions",
                            "gpt-4o", 200, 10, 20)
        entries = _entries(rec, 0)
        assert t.exporter.export(entries) == SpanExportResult.SUCCESS
        assert sent == [t.exporter.spans.encoded(entries)]
        assert t.exporter.exported == 1
    finally:
        t.close(timeout_s=5)

    got: list[Any] = []

    class Collecting(_NoExport):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            got.extend(spans)
            return SpanExportResult.SUCCESS

    other = Tracer(exporter=Collecting(), schedule_delay_ms=3_600_000)
    try:
        assert other.exporter.send is None
        other.exporter.export(entries)
        assert [s.name for s in got] == ["chat gpt-4o"]
        assert span_data(entries[0]).name == "chat gpt-4o"
    finally:
        other.close(timeout_s=5)


def test_the_benchmarks_sink_takes_what_the_exporter_sends() -> None:
    """benches/e2e/otlpsink.py (the collector of the end-to-end tracing figures) answers the
    SDK's exporter, which counts the spans exported, and counts the export and its bytes."""
    from benches.e2e.otlpsink import Sink

    sink = Sink()
    t = Tracer(sink.endpoint, schedule_delay_ms=3_600_000)
    try:
        rec = RequestRecord(RequestTrace(5, 6, 0, True), "chat", "POST", "/v1/chat/completions",
                            "gpt-4o", 200, 10, 20)
        assert t.record(rec) == 1
        t.close(timeout_s=30)  # exports what waits
        assert t.stats()["exported"] == 1
        counts = sink.counts()
        assert counts["exports"] == 1
        assert counts["bytes"] == len(t.exporter.spans.encoded([Pending(rec, None, 0)])) > 0
    finally:
        sink.close()
