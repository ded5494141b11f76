"""velox/spend/trace.py against a real OTLP/HTTP receiver: an HTTP server in the test decoding the
protobuf (opentelemetry-proto) that the official exporter sends, fed synthetic records of
settled requests. Also: traceparent parsing and propagation, sampling, and collectors that are
dead or silent (spans dropped and counted, no call blocked, memory bounded).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

from tests.otlp import Receiver, closed_port, silent_collector
from velox.spend import trace
from velox.spend.trace import (
    AttemptSpan,
    RequestRecord,
    Tracer,
    format_traceparent,
    is_sampled,
    parse_traceparent,
)

CLIENT_TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN = 0x00F067AA0BA902B7
TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def tracers() -> Iterator[list[Tracer]]:
    made: list[Tracer] = []
    yield made
    for t in made:
        t.close(timeout_s=5)


def _tracer(tracers: list[Tracer], endpoint: str, **kw: Any) -> Tracer:
    kw.setdefault("schedule_delay_ms", 20)
    t = Tracer(endpoint, **kw)
    tracers.append(t)
    return t


def _record(t: Tracer, traceparent: bytes | None = TRACEPARENT, attempts: int = 3,
            **kw: Any) -> RequestRecord:
    """A chat request tried `attempts` times: connect error, then 503s, then a 200."""
    rt = t.start(traceparent)
    t0 = time.perf_counter_ns()
    tries = []
    for n in range(attempts):
        last = n == attempts - 1
        status = 200 if last else (0 if n == 0 else 503)
        tries.append(AttemptSpan(
            rt.new_span_id(), f"up{n}", "openai" if n % 2 == 0 else "anthropic",
            f"upstream{n}.example", 443, f"model-{n}", t0 + 1_000_000 * (n + 1),
            t0 + 1_000_000 * (n + 2), status=status, error="connect" if status == 0 else "",
            response_model="gpt-4o-2024-08-06" if last else "",
            finish_reasons=("stop",) if last else (), input_tokens=12 if last else None,
            output_tokens=5 if last else None))
    fields: dict[str, Any] = {
        "operation": "chat", "method": "POST", "path": "/v1/chat/completions", "model": "gpt-4o",
        "status": 200, "start_ns": t0, "end_ns": t0 + 1_000_000 * (attempts + 3),
        "queued_ns": t0 + 10_000, "parsed_ns": t0 + 20_000, "limits_ns": t0 + 30_000,
        "cache_ns": t0 + 40_000, "cache_hit": False, "key": "alice", "route": "gpt-4o",
        "response_model": "gpt-4o-2024-08-06", "finish_reasons": ("stop",), "input_tokens": 12,
        "output_tokens": 5, "cost_nanos": 80_000, "attempts": tries}
    fields.update(kw)
    return RequestRecord(rt, **fields)


def test_one_server_span_and_a_client_span_per_attempt_with_genai_attributes(
        receiver: Receiver, tracers: list[Tracer]) -> None:
    t = _tracer(tracers, receiver.endpoint)
    rec = _record(t)
    before = time.time_ns()
    assert t.record(rec) == 4
    spans = receiver.wait_for(4)
    server = next(s for s in spans if s["kind"] == 2)  # SPAN_KIND_SERVER
    clients = sorted((s for s in spans if s["kind"] == 3), key=lambda s: s["start"])
    assert len(clients) == 3
    trace_hex = f"{CLIENT_TRACE:032x}"
    assert server["name"] == "chat gpt-4o"
    assert server["trace_id"] == trace_hex and server["parent"] == f"{CLIENT_SPAN:016x}"
    assert server["span_id"] == f"{rec.trace.span_id:016x}"
    assert server["attrs"] == {
        "http.request.method": "POST", "url.path": "/v1/chat/completions",
        "http.response.status_code": 200, "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "gpt-4o", "velox.attempts": 3,
        "gen_ai.provider.name": "openai",
        "gen_ai.response.model": "gpt-4o-2024-08-06",
        "gen_ai.response.finish_reasons": ["stop"], "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 5, "velox.key": "alice", "velox.route": "gpt-4o",
        "velox.cost_usd": 8e-05, "velox.cache.hit": False}
    assert [e[0] for e in server["events"]] == ["velox.queued", "velox.parsed",
                                                "velox.limits", "velox.cache"]
    # Monotonic times became wall-clock times, in order and around now.
    times = [server["start"], *(e[1] for e in server["events"]), server["end"]]
    assert times == sorted(times)
    assert before - 60 * 10**9 < server["start"] < time.time_ns()
    assert server["resource"]["service.name"] == "velox" and server["scope"] == "velox"
    for n, span in enumerate(clients):
        attempt = rec.attempts[n]
        assert span["trace_id"] == trace_hex and span["parent"] == server["span_id"]
        assert span["span_id"] == f"{attempt.span_id:016x}"
        assert span["name"] == f"chat model-{n}"
        provider = "openai" if n % 2 == 0 else "anthropic"
        assert span["attrs"]["gen_ai.provider.name"] == provider
        assert "gen_ai.system" not in span["attrs"]  # deprecated: gen_ai.provider.name
        assert span["attrs"]["gen_ai.request.model"] == f"model-{n}"
        assert span["attrs"]["server.address"] == f"upstream{n}.example"
        assert span["attrs"]["server.port"] == 443
    assert clients[0]["attrs"]["error.type"] == "connect" and clients[0]["status"] == 2
    assert clients[1]["attrs"]["error.type"] == "503"
    assert clients[1]["attrs"]["http.response.status_code"] == 503
    assert "error.type" not in clients[2]["attrs"] and clients[2]["status"] == 0
    assert clients[2]["attrs"]["gen_ai.usage.output_tokens"] == 5
    assert clients[2]["attrs"]["gen_ai.response.finish_reasons"] == ["stop"]
    deadline = time.monotonic() + 60  # the exporter counts once the receiver has answered
    while t.stats()["exported"] < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.stats() == {"submitted": 4, "exported": 4, "failed": 0, "dropped": 0,
                         "pending": 0}


def test_traceparent_in_same_trace_out_to_the_upstream(
        receiver: Receiver, tracers: list[Tracer]) -> None:
    t = _tracer(tracers, receiver.endpoint)
    rec = _record(t, attempts=1)
    header = rec.trace.traceparent(rec.attempts[0].span_id)
    assert header == format_traceparent(CLIENT_TRACE, rec.attempts[0].span_id, True)
    sent = parse_traceparent(header)
    assert sent is not None and sent.trace_id == CLIENT_TRACE and sent.sampled
    t.record(rec)
    client = next(s for s in receiver.wait_for(2) if s["kind"] == 3)
    assert client["span_id"] == f"{sent.span_id:016x}"
    # Without a traceparent the request starts its own trace, and sends it upstream.
    own = t.start(None)
    assert own.parent_span_id == 0 and own.trace_id != CLIENT_TRACE
    assert parse_traceparent(own.traceparent(7)) == (own.trace_id, 7, own.sampled)


def test_unsampled_requests_export_nothing(receiver: Receiver, tracers: list[Tracer]) -> None:
    t = _tracer(tracers, receiver.endpoint, sample=0.0)
    assert t.record(_record(t, traceparent=None)) == 0  # ratio 0: never sampled
    unsampled_parent = TRACEPARENT[:-2] + b"00"
    assert t.record(_record(t, traceparent=unsampled_parent)) == 0  # the client's decision
    # A sampled parent is followed even at ratio 0; its spans are the only ones to arrive.
    assert t.record(_record(t, attempts=1)) == 2
    spans = receiver.wait_for(2)
    t.close()
    assert len(receiver.spans) == 2 and {s["trace_id"] for s in spans} == {f"{CLIENT_TRACE:032x}"}


def test_the_sampling_ratio(tracers: list[Tracer]) -> None:
    assert is_sampled(0x1234 << 64 | (1 << 62) - 1, 0.25)
    assert not is_sampled((1 << 62), 0.25)
    assert is_sampled((1 << 64) - 1, 1.0) and not is_sampled(0, 0.0)
    t = _tracer(tracers, "http://127.0.0.1:9", sample=0.01)
    sampled = sum(t.start(None).sampled for _ in range(20_000))
    assert 100 <= sampled <= 320  # 200 expected; +-7 standard deviations


def _in_thread(work: Callable[[], None], what: str, timeout: float = 120.0) -> None:
    """Run `work` and fail (rather than hang the suite) if it never returns."""
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{what} blocked"


@pytest.mark.parametrize("collector", ["dead", "silent"])
def test_an_unreachable_collector_drops_counted_spans_and_blocks_nothing(
        collector: str, tracers: list[Tracer]) -> None:
    held: list[socket.socket] = []
    if collector == "silent":
        listener, accepted, held, acceptor = silent_collector()
        endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    else:
        endpoint = f"http://127.0.0.1:{closed_port()}"
    exporter = OTLPSpanExporter(endpoint=endpoint + trace.TRACES_PATH, timeout=3)
    t = Tracer(exporter=exporter, max_queue=64, schedule_delay_ms=10)
    if collector == "silent":
        t.record(_record(t, attempts=1))
        assert accepted.wait(60), "the exporter never reached the silent collector"
    requests = 2000

    def record_many() -> None:
        for _ in range(requests):
            t.record(_record(t, attempts=1))

    _in_thread(record_many, "recording")
    stats = t.stats()
    sent = 2 * (requests + (collector == "silent"))
    assert stats["submitted"] + stats["dropped"] == sent
    assert stats["pending"] <= 64 and stats["dropped"] >= sent - 64 - 2 * 64
    assert stats["exported"] == 0
    _in_thread(lambda: t.close(timeout_s=2), "closing", timeout=60)
    if collector == "silent":
        listener.shutdown(socket.SHUT_RDWR)  # its accept() fails: the thread returns
        acceptor.join(10)
        assert not acceptor.is_alive()
        listener.close()
    for conn in held:
        conn.close()


def test_traceparent_parsing() -> None:
    assert parse_traceparent(TRACEPARENT) == (CLIENT_TRACE, CLIENT_SPAN, True)
    assert parse_traceparent(TRACEPARENT.decode().upper()) == (CLIENT_TRACE, CLIENT_SPAN, True)
    assert parse_traceparent(TRACEPARENT[:-2] + b"00") == (CLIENT_TRACE, CLIENT_SPAN, False)
    # A later version may add fields after a dash; it is read for the four it shares.
    assert parse_traceparent(b"01" + TRACEPARENT[2:] + b"-what-ever") is not None
    for bad in (b"", None, b"00-" + b"0" * 32 + b"-00f067aa0ba902b7-01",
                b"00-4bf92f3577b34da6a3ce929d0e0e4736-" + b"0" * 16 + b"-01",
                b"ff" + TRACEPARENT[2:], TRACEPARENT + b"-extra", TRACEPARENT[:-1],
                b"00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01", b"garbage"):
        assert parse_traceparent(bad) is None, bad
