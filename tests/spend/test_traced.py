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
from velox.core.types import QUEUED
from velox.spend.trace import Tracer, answer_fields, parse_traceparent
from velox.spend.traced import _Keeper
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
    assert answer_fields(_kept(body[:40], body[40:]).pieces) == ("gpt-4o-2024-08-06",
                                                          ("stop", "length"), 12, 5)


def test_fields_of_an_openai_stream() -> None:
    events = [{"model": "gpt-4o-mini", "choices": [{"delta": {"content": "a"},
                                                     "finish_reason": None}]},
              {"model": "gpt-4o-mini", "choices": [{"delta": {}, "finish_reason": "stop"}]},
              {"model": "gpt-4o-mini", "choices": [],
               "usage": {"prompt_tokens": 7, "completion_tokens": 2}}]
    stream = [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]
    assert answer_fields(_kept(*stream).pieces) == ("gpt-4o-mini", ("stop",), 7, 2)
    # Without usage in the stream (the client did not ask for it): none is made up.
    assert answer_fields(_kept(*stream[:2]).pieces) == ("gpt-4o-mini", ("stop",), None, None)


def test_fields_of_anthropic_answers() -> None:
    whole = orjson.dumps({"type": "message", "model": "claude-sonnet-4-5",
                          "stop_reason": "end_turn", "content": [],
                          "usage": {"input_tokens": 30, "output_tokens": 9}})
    assert answer_fields(_kept(whole).pieces) == ("claude-sonnet-4-5", ("end_turn",), 30, 9)
    stream = (b'event: message_start\ndata: {"type":"message_start","message":{"model":'
              b'"claude-sonnet-4-5","stop_reason":null,"usage":{"input_tokens":30,'
              b'"output_tokens":1}}}\n\n'
              b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
              b'"max_tokens"},"usage":{"output_tokens":64}}\n\n')
    assert answer_fields(_kept(stream).pieces) == ("claude-sonnet-4-5", ("max_tokens",), 30, 64)


def test_nothing_kept_nothing_read() -> None:
    assert answer_fields(()) == ("", (), None, None)
    assert answer_fields(_kept(b"[1, 2]").pieces) == ("", (), None, None)


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
    """A worker's tracing at VELOX_OTEL_SAMPLE=0, its first upstream as a traced request's
    attempts see it (wrapped), and what that upstream was given to send."""
    pipeline = Pipeline(clients=2, VELOX_OTEL_ENDPOINT="http://127.0.0.1:9",
                        VELOX_OTEL_SAMPLE="0")
    traced = pipeline.worker.traced
    assert traced is not None
    upstream: Any = traced.wrapped[0]
    sent = _Sent()
    upstream.inner = sent
    return traced, upstream, sent


def _queued(traceparent: bytes | None = None, headers: Sequence[tuple[bytes, bytes]] = ()
            ) -> Any:
    """A request as it enters the pipeline (the fields tracing reads)."""
    return SimpleNamespace(headers=list(headers), ends=object(), conn=None, t_popped=0,
                           state=QUEUED, traceparent=traceparent)


CLIENT_UNSAMPLED = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


def test_a_clients_unsampled_trace_is_kept_over_attempts_with_a_span_each() -> None:
    """Unsampled requests: the client's trace goes on upstream (a span of ours per attempt,
    its flag obeyed, its own field replaced); one without a traceparent leaves no entry and
    sends none."""
    traced, upstream, sent = _unsampled_upstream()
    dispatch = traced.dispatch
    assert dispatch.upstreams is traced.plain  # nothing traced in flight
    mine = (b"traceparent", CLIENT_UNSAMPLED)
    request, alone = _queued(CLIENT_UNSAMPLED, [mine]), _queued()
    traced.decide([alone, request])
    assert list(traced.live) == [id(request)] and dispatch.upstreams is traced.wrapped
    base = [(b"content-type", b"application/json"), mine]
    shared = [(b"x-api-key", b"k"), mine]  # a translated attempt's headers may be its upstream's
    for edge, headers in ((None, base), (None, base), (object(), shared)):
        # dispatch makes each plain attempt's list anew
        exchange = SimpleNamespace(request=request, edge=edge,
                                   headers_out=list(headers) if edge is None else headers)
        upstream.submit(exchange)
    assert shared == [(b"x-api-key", b"k"), mine]  # not written into
    parents = [parse_traceparent(dict(h)[b"traceparent"]) for h in sent.headers]
    assert all(p is not None and not p.sampled for p in parents)
    assert {p.trace_id for p in parents if p} == {0x0af7651916cd43dd8448eb211c80319c}
    assert len({p.span_id for p in parents if p} | {0xb7ad6b7169203331}) == 4  # a span each
    assert all(len(h) == 2 for h in sent.headers)  # one traceparent each, nothing else added
    upstream.submit(SimpleNamespace(request=alone, edge=None, headers_out=[]))
    assert sent.headers[-1] == []  # the request without one: nothing added
    traced.ended(request, 200, None)
    assert not traced.live and dispatch.upstreams is traced.plain
    traced.tracer.close(timeout_s=1)


def test_an_unsampled_merged_batch_call_sends_no_traceparent_and_keeps_nothing() -> None:
    """A merged call is traced only when a member is: otherwise it goes as an unsampled
    request does (its exchange's end is left alone)."""
    traced, upstream, sent = _unsampled_upstream()
    members = [SimpleNamespace(live=True, request=_queued()) for _ in range(3)]
    traced.decide([m.request for m in members])
    call = BatchCall(None, None, members)  # type: ignore[arg-type]  # its members alone
    merged = SimpleNamespace(conn=call, ends=call, headers=[], model="emb")
    ended: list[int] = []
    on_done = lambda ex, status: ended.append(status)  # noqa: E731
    exchange = SimpleNamespace(request=merged, edge=None, headers_out=[], observer=None,
                               on_done=on_done)
    upstream.submit(exchange)
    assert sent.headers == [[]] and exchange.on_done is on_done and not traced.live
    traced.tracer.close(timeout_s=1)
