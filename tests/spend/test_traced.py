"""velox/spend/traced.py without sockets: what is read from an answer (OpenAI's and Anthropic's,
whole and streamed), nothing installed when tracing is off, the spans of a socket-free worker
when it is on, and start-up refused when the endpoint is set without the extra."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace.export import SpanExportResult

from velox.batching.batch import BatchCall
from velox.config import settings as settings_module
from velox.config.settings import ConfigError, load
from velox.core.fields import F
from velox.spend.trace import Tracer, parse_traceparent
from velox.spend.traced import _answer_fields, _Keeper
from velox_lab.pipeline import Pipeline


def _kept(*pieces: bytes) -> _Keeper:
    keeper = _Keeper(None)
    for piece in pieces:
        keeper.data(piece)
    return keeper


def test_fields_of_a_whole_openai_answer() -> None:
    body = orjson.dumps({"id": "x", "model": "gpt-4o-2024-08-06", "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"content": "hi"}},
        {"index": 1, "finish_reason": "length", "message": {"content": "h"}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}})
    assert _answer_fields(_kept(body[:40], body[40:])) == ("gpt-4o-2024-08-06",
                                                          ("stop", "length"), 12, 5)


def test_fields_of_an_openai_stream() -> None:
    events = [{"model": "gpt-4o-mini", "choices": [{"delta": {"content": "a"},
                                                     "finish_reason": None}]},
              {"model": "gpt-4o-mini", "choices": [{"delta": {}, "finish_reason": "stop"}]},
              {"model": "gpt-4o-mini", "choices": [],
               "usage": {"prompt_tokens": 7, "completion_tokens": 2}}]
    stream = [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]
    assert _answer_fields(_kept(*stream)) == ("gpt-4o-mini", ("stop",), 7, 2)
    # Without usage in the stream (the client did not ask for it): none is made up.
    assert _answer_fields(_kept(*stream[:2])) == ("gpt-4o-mini", ("stop",), None, None)


def test_fields_of_anthropic_answers() -> None:
    whole = orjson.dumps({"type": "message", "model": "claude-sonnet-4-5",
                          "stop_reason": "end_turn", "content": [],
                          "usage": {"input_tokens": 30, "output_tokens": 9}})
    assert _answer_fields(_kept(whole)) == ("claude-sonnet-4-5", ("end_turn",), 30, 9)
    stream = (b'event: message_start\ndata: {"type":"message_start","message":{"model":'
              b'"claude-sonnet-4-5","stop_reason":null,"usage":{"input_tokens":30,'
              b'"output_tokens":1}}}\n\n'
              b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
              b'"max_tokens"},"usage":{"output_tokens":64}}\n\n')
    assert _answer_fields(_kept(stream)) == ("claude-sonnet-4-5", ("max_tokens",), 30, 64)


def test_nothing_kept_nothing_read() -> None:
    assert _answer_fields(None) == ("", (), None, None)
    assert _answer_fields(_kept(b"[1, 2]")) == ("", (), None, None)


def test_off_installs_nothing() -> None:
    pipeline = Pipeline(clients=2)
    worker = pipeline.worker
    assert worker.traced is None and worker.dispatch.tracer is None
    assert all(a is b for a, b in zip(worker.dispatch.upstreams, worker.upstreams, strict=True))
    assert "finished" not in vars(worker)  # the class's method, not tracing's
    assert [name for name, _ in worker.stages] == ["parse", "limit", "send"]
    pipeline.round()
    assert pipeline.worker.in_flight == 0


class _Spans:
    def __init__(self) -> None:
        self.spans: list[Any] = []

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def test_on_a_server_and_a_client_span_per_request() -> None:
    pipeline = Pipeline(clients=8, VELOX_OTEL_ENDPOINT="http://127.0.0.1:9")
    traced = pipeline.worker.traced
    assert traced is not None
    traced.tracer.close(timeout_s=1)
    exporter = _Spans()
    traced.tracer = Tracer(exporter=exporter, schedule_delay_ms=10)
    pipeline.round()
    assert pipeline.worker.in_flight == 0 and not traced.live  # nothing left per request
    traced.tracer.close(timeout_s=30)
    servers = [s for s in exporter.spans if s.kind.name == "SERVER"]
    clients = [s for s in exporter.spans if s.kind.name == "CLIENT"]
    assert len(servers) == 8 and len(clients) == 8
    by_id = {s.context.span_id: s for s in servers}
    for span in clients:
        server = by_id[span.parent.span_id]
        assert span.context.trace_id == server.context.trace_id
        assert span.name == "chat gpt-4o-mini" == server.name
        assert span.attributes["gen_ai.usage.input_tokens"] > 0
        assert span.attributes["server.address"] == "upstream.invalid"
        assert span.attributes["http.response.status_code"] == 200
    traced.tick()
    counters = pipeline.worker.counters.snapshot()[0]
    assert counters[F.TRACE_SPANS_EXPORTED] == 16 and counters[F.TRACE_SPANS_DROPPED] == 0


def test_an_endpoint_without_the_extra_stops_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"VELOX_UPSTREAM_ORIGIN": "https://api.openai.com",
           "VELOX_OTEL_ENDPOINT": "http://127.0.0.1:4318"}
    assert load(env, dotenv=None).otel_endpoint == "http://127.0.0.1:4318"
    monkeypatch.setattr(settings_module, "_installed",
                        lambda module: not module.startswith("opentelemetry"))
    with pytest.raises(ConfigError, match=r"VELOX_OTEL_ENDPOINT .*pip install 'velox\[otel\]'"):
        load(env, dotenv=None)
    del env["VELOX_OTEL_ENDPOINT"]
    assert load(env, dotenv=None).otel_endpoint == ""  # no endpoint: the extra is not needed


class _Sent:
    """An upstream recording the headers of each attempt submitted to it."""

    def __init__(self) -> None:
        self.headers: list[list[tuple[bytes, bytes]]] = []

    def submit(self, client: Any, number: int = 0) -> None:
        self.headers.append(list(client.headers_out))


def _unsampled_upstream() -> tuple[Any, Any, _Sent]:
    """A worker's tracing at VELOX_OTEL_SAMPLE=0, its first traced upstream, and what that
    upstream was given to send."""
    pipeline = Pipeline(clients=2, VELOX_OTEL_ENDPOINT="http://127.0.0.1:9",
                        VELOX_OTEL_SAMPLE="0")
    traced = pipeline.worker.traced
    assert traced is not None
    upstream: Any = pipeline.worker.dispatch.upstreams[0]
    sent = _Sent()
    upstream.inner = sent
    return traced, upstream, sent


def test_an_unsampled_request_keeps_its_trace_over_attempts_with_a_span_each() -> None:
    traced, upstream, sent = _unsampled_upstream()
    request = SimpleNamespace(headers=[(b"content-type", b"application/json")], ends=object(),
                              conn=None, traceparent=None)
    base = [(b"content-type", b"application/json")]
    shared = [(b"x-api-key", b"k")]  # a translated attempt's headers may be its upstream's
    for edge, headers in ((None, base), (None, base), (object(), shared)):
        # dispatch makes each plain attempt's list anew
        exchange = SimpleNamespace(request=request, edge=edge,
                                   headers_out=list(headers) if edge is None else headers)
        upstream.submit(exchange)
    assert shared == [(b"x-api-key", b"k")]  # not written into
    parents = [parse_traceparent(dict(h)[b"traceparent"]) for h in sent.headers]
    assert all(p is not None and not p.sampled for p in parents)
    assert len({p.trace_id for p in parents if p}) == 1  # one trace
    assert len({p.span_id for p in parents if p}) == 3  # a span per attempt
    assert all(len(h) == 2 for h in sent.headers)  # one traceparent each, nothing else added
    del traced.live[id(request)]
    traced.tracer.close(timeout_s=1)


def test_an_unsampled_merged_batch_call_leaves_nothing_behind() -> None:
    """A merged call is no client's request (no `finished` ends it): its trace entry goes
    when its exchange ends, sampled or not."""
    traced, upstream, sent = _unsampled_upstream()
    members = [SimpleNamespace(live=True, request=SimpleNamespace(
        headers=[], ends=object(), traceparent=None)) for _ in range(3)]
    call = BatchCall(None, None, members)  # type: ignore[arg-type]  # its members alone
    merged = SimpleNamespace(conn=call, ends=call, headers=[], model="emb")
    ended: list[int] = []
    exchange = SimpleNamespace(request=merged, edge=None, headers_out=[], observer=None,
                               on_done=lambda ex, status: ended.append(status))
    upstream.submit(exchange)
    (upstream_saw,) = [parse_traceparent(dict(h)[b"traceparent"]) for h in sent.headers]
    assert upstream_saw is not None and not upstream_saw.sampled
    exchange.on_done(exchange, 200)
    assert ended == [200]  # the call's own end still runs
    for member in members:  # the members' entries go at their own ends
        assert isinstance(traced.live.pop(id(member.request)), bytes)
    assert not traced.live
    traced.tracer.close(timeout_s=1)
