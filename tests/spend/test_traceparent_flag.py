"""A client's `traceparent` as ingress notes it while reading the head (Request.traceparent:
the native head parser's flag, and httptools' path as its twin), and what a tracing worker
does with it: in any field position and letter case it is followed (same trace id upstream,
its sampled flag obeyed), sent twice or malformed it starts a new trace (the W3C Trace Context
test suite's expectation for a repeated field), and the client's own field never goes
upstream beside the gateway's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from velox.core.types import Request
from velox.spend.trace import parse_traceparent

from ..native.test_reqhead_fuzz import make
from .test_traced import _Sent, _unsampled_upstream

PARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
OTHER = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
PARENT_TRACE = 0x4bf92f3577b34da6a3ce929d0e0e4736
OTHER_TRACE = 0x0af7651916cd43dd8448eb211c80319c
BODY = b'{"model":"gpt-4o-mini","messages":[]}'


def _request(fields: list[bytes]) -> bytes:
    """A chat request with these fields between the SDK's usual ones."""
    head = [b"Host: 127.0.0.1:8080", *fields[:1], b"Content-Type: application/json",
            *fields[1:2], b"Authorization: Bearer sk-x", *fields[2:],
            b"Content-Length: %d" % len(BODY)]
    return b"POST /v1/chat/completions HTTP/1.1\r\n" + b"\r\n".join(head) + b"\r\n\r\n" + BODY


# (the fields a client sends, the Request.traceparent ingress notes)
CASES = {
    "none": ([b"X-A: 1"], None),
    "first": ([b"traceparent: " + PARENT], PARENT),
    "middle": ([b"X-A: 1", b"TraceParent: " + PARENT], PARENT),
    "last, upper case": ([b"X-A: 1", b"X-B: 2", b"TRACEPARENT:  " + PARENT], PARENT),
    "trailing space kept": ([b"traceparent: " + PARENT + b" "], PARENT + b" "),
    "duplicated": ([b"traceparent: " + PARENT, b"X-A: 1", b"Traceparent: " + OTHER], b""),
    "duplicated alike": ([b"traceparent: " + PARENT, b"traceparent: " + PARENT], b""),
    "malformed": ([b"traceparent: 00-xyz-01"], b"00-xyz-01"),
    "empty": ([b"traceparent:"], b""),
    "look-alikes": ([b"tracestate: a=1", b"traceparents: " + PARENT, b"x-traceparent: 1"], None),
}


def _ingress(parser: str, raw: bytes) -> Request:
    conn, _, ring = make(parser, answer=False)
    conn.data_received(raw)
    (request,) = ring.pushed
    assert conn._native is (parser == "native")  # the head stayed on the path under test
    return request


@pytest.mark.parametrize("parser", ["native", "httptools"])
@pytest.mark.parametrize("case", list(CASES))
def test_ingress_notes_the_clients_traceparent(parser: str, case: str) -> None:
    fields, noted = CASES[case]
    request = _ingress(parser, _request(fields))
    assert request.traceparent == noted
    if noted:  # the very value among the headers, not a copy made apart
        assert any(value is request.traceparent for _, value in request.headers)


def _sent_upstream(traced: Any, upstream: Any, sent: _Sent, request: Request) -> Any:
    """Decide the request's trace as the pipeline does and submit its first attempt to the
    traced upstream; the traceparent it sent (None: it sent none)."""
    headers = [h for h in request.headers if h[0] != b"authorization"]  # as dispatch's copy
    request.ends = object()  # type: ignore[assignment]  # a worker's request (not a test's own)
    traced.decide([request])
    exchange = SimpleNamespace(request=request, edge=None, headers_out=headers, observer=None,
                               routing=SimpleNamespace(attempt=None))
    upstream.submit(exchange)
    (out,) = sent.headers[-1:]
    parents = [value for name, value in out if name == b"traceparent"]
    assert len(parents) == (id(request) in traced.live), out  # never the client's beside ours
    traced._forget(request)
    return parse_traceparent(parents[0]) if parents else None


@pytest.mark.parametrize("parser", ["native", "httptools"])
def test_a_tracing_worker_follows_one_valid_traceparent_only(parser: str) -> None:
    traced, upstream, sent = _unsampled_upstream()  # VELOX_OTEL_SAMPLE=0
    try:
        for case, (fields, _) in CASES.items():
            out = _sent_upstream(traced, upstream, sent, _ingress(parser, _request(fields)))
            if case in ("first", "middle", "last, upper case", "trailing space kept"):
                # The client's trace, a span of ours, its sampled flag obeyed at ratio 0.
                assert out is not None, case
                assert (out.trace_id, out.sampled) == (PARENT_TRACE, True), case
                assert out.span_id != 0x00f067aa0ba902b7, case
            elif fields[0].lower().startswith(b"traceparent"):
                # Nothing to follow: a new trace, unsampled at ratio 0, and the client's field
                # replaced by it.
                assert out is not None, case
                assert out.trace_id not in (PARENT_TRACE, OTHER_TRACE), case
                assert not out.sampled, case
            else:  # none sent, none sent on: unsampled requests have no trace of ours
                assert out is None, case
        assert not traced.live
    finally:
        traced.tracer.close(timeout_s=1)
