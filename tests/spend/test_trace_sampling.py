"""Sampling by countdown (velox.spend.trace.next_sampled, velox.spend.traced.Traced.sample): the
gaps between sampled requests are geometric, so each request is sampled with the configured
odds; a sampled request's trace id is one TraceIdRatioBased keeps at that ratio; a worker's
socket-free pipeline samples its share, leaves no entry behind, and unwraps its upstreams when no
traced request is in flight; a request refused at parse is traced; one back from the off-loop
scan is not decided twice."""

from __future__ import annotations

import random
import statistics
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased

from velox.core.types import DONE, QUEUED
from velox.spend.trace import (
    NEVER,
    Tracer,
    is_sampled,
    next_sampled,
    sample_bound,
    sampled_trace_id,
)
from velox_lab.pipeline import CHAT_BODY, CLIENT_REQUEST, Pipeline

from .test_traced import _Spans


@pytest.mark.parametrize("ratio", [0.01, 0.3])
def test_gaps_give_each_request_the_ratio_s_odds(ratio: float) -> None:
    draws = random.Random(20)
    gaps = [next_sampled(ratio, draws.random()) for _ in range(20_000)]
    assert min(gaps) == 1
    # Geometric: mean 1/ratio, P(gap = 1) = ratio; bounds at 6 standard deviations.
    spread = (1 - ratio) ** 0.5 / ratio / len(gaps) ** 0.5
    assert abs(statistics.fmean(gaps) - 1 / ratio) < 6 * spread
    ones = sum(g == 1 for g in gaps) / len(gaps)
    assert abs(ones - ratio) < 6 * (ratio * (1 - ratio) / len(gaps)) ** 0.5


def test_gaps_at_the_ends() -> None:
    assert next_sampled(1.0, 0.999) == 1 and next_sampled(0.5, 0.0) == 1
    assert next_sampled(0.0, 0.5) == NEVER and next_sampled(1e-30, 0.5) == NEVER
    assert next_sampled(1e-18, 0.999999) == NEVER  # capped, never past it


@pytest.mark.parametrize("ratio", [0.01, 0.5, 1.0])
def test_a_sampled_trace_id_is_one_the_sdk_samples_at_that_ratio(ratio: float) -> None:
    sdk = TraceIdRatioBased(ratio)
    ids = [sampled_trace_id(ratio) for _ in range(2000)]
    assert all(0 < i < 1 << 128 and is_sampled(i, ratio) for i in ids)
    assert all(sdk.should_sample(None, i, "x").decision is Decision.RECORD_AND_SAMPLE
               for i in ids[:200])
    low = [i & ((1 << 64) - 1) for i in ids]
    assert max(low) > 0.9 * sample_bound(ratio)  # spread over the whole range below the bound
    assert len({i >> 64 for i in ids}) == len(ids)  # the high half random


def _traced_pipeline(sample: str) -> tuple[Pipeline, Any, _Spans]:
    pipeline = Pipeline(clients=64, VELOX_OTEL_ENDPOINT="http://127.0.0.1:9",
                        VELOX_OTEL_SAMPLE=sample)
    traced = pipeline.worker.traced
    assert traced is not None
    traced.tracer.close(timeout_s=1)
    exporter = _Spans()
    traced.tracer = Tracer(exporter=exporter, sample=float(sample), max_queue=1 << 16,
                           schedule_delay_ms=10)
    return pipeline, traced, exporter


def test_a_worker_samples_its_share_and_keeps_nothing_of_the_rest() -> None:
    pipeline, traced, exporter = _traced_pipeline("0.25")
    rounds = 40
    for _ in range(rounds):
        pipeline.send_requests()
        # Wrapped while (and only while) a traced request is in flight.
        assert (traced.dispatch.upstreams is traced.wrapped) == bool(traced.live)
        pipeline.answer_streams()
        # Every request answered: no entry left, the upstreams unwrapped.
        assert not traced.live and traced.dispatch.upstreams is traced.plain
    assert pipeline.worker.in_flight == 0
    traced.tracer.close(timeout_s=30)
    servers = [s for s in exporter.spans if s.kind.name == "SERVER"]
    clients = [s for s in exporter.spans if s.kind.name == "CLIENT"]
    requests = rounds * 64
    assert abs(len(servers) - requests / 4) < 6 * (requests * 0.25 * 0.75) ** 0.5
    assert len(clients) == len(servers)  # one attempt each, under its request's span
    by_id = {s.context.span_id: s for s in servers}
    assert all(by_id[c.parent.span_id].context.trace_id == c.context.trace_id for c in clients)
    assert all(is_sampled(s.context.trace_id, 0.25) for s in servers)


def test_ratio_0_never_wraps_nor_keeps_anything() -> None:
    pipeline, traced, exporter = _traced_pipeline("0")
    for _ in range(5):
        pipeline.send_requests()  # 64 requests in flight, none traced
        assert pipeline.worker.in_flight == 64
        assert not traced.live and traced.dispatch.upstreams is traced.plain
        pipeline.answer_streams()
    assert traced.countdown > NEVER - 1000
    traced.tracer.close(timeout_s=5)
    assert exporter.spans == []


def test_a_request_refused_at_parse_has_its_server_span() -> None:
    pipeline, traced, exporter = _traced_pipeline("1")
    bad = CLIENT_REQUEST.replace(CHAT_BODY, b"{" + CHAT_BODY[1:-1] + b",}")
    client, transport = pipeline.clients[0]
    transport.keep = True
    client.data_received(bad)
    pipeline.loop.run_ready()
    assert b" 400 " in b"".join(transport.chunks).split(b"\r\n", 1)[0] + b" "
    traced.tracer.close(timeout_s=30)
    (span,) = exporter.spans
    assert span.kind.name == "SERVER"
    assert span.attributes["http.response.status_code"] == 400
    assert not traced.live and traced.dispatch.upstreams is traced.plain


def _queued(**fields: Any) -> Any:
    return SimpleNamespace(**{"ends": object(), "conn": None, "t_popped": 0, "state": QUEUED,
                              "traceparent": None, **fields})


@pytest.mark.parametrize("way", ["due", "decide"])
def test_a_request_seen_before_or_over_is_left_alone_and_the_sample_goes_on(way: str) -> None:
    """`due` (a batch without a client's traceparent: only the requests the countdown falls
    on) and `decide` (request by request) agree."""
    _, traced, _ = _traced_pipeline("0.01")
    back = _queued(t_popped=123)  # back from the off-loop scan: decided on its first pass
    gone = _queued(state=DONE)  # its client left while it queued
    fresh, after = _queued(), _queued()
    traced.countdown = 1  # the next request is due
    getattr(traced, way)([back, gone, fresh, after])
    assert list(traced.live) == [id(fresh)]
    assert traced.live[id(fresh)].trace.sampled and traced.countdown >= 1
    assert type(fresh.ends).__name__ == "_TracedEnd" and back.ends is not fresh.ends
    traced._forget(fresh)
    assert traced.dispatch.upstreams is traced.plain
    traced.tracer.close(timeout_s=1)


def test_due_samples_the_requests_decide_would_from_the_same_draws() -> None:
    """Over batches of every size, countdowns carried across them and requests not to be
    traced here and there, `due` traces the same requests as `decide` and leaves the same
    countdown, given the same random draws."""
    _, traced, _ = _traced_pipeline("0.2")
    shapes = random.Random(7)
    for _ in range(300):
        flags = [shapes.random() < 0.15 for _ in range(shapes.randint(1, 40))]
        countdown = shapes.randint(-3, 12)
        seed = shapes.random()
        picked = []
        for way in ("due", "decide"):
            batch = [_queued(t_popped=1) if skip else _queued() for skip in flags]
            traced.countdown = countdown
            random.seed(seed)
            getattr(traced, way)(batch)
            # a countdown at or below 1 means the same: the next batch's first is due
            picked.append(([n for n, r in enumerate(batch) if id(r) in traced.live],
                           max(traced.countdown, 1)))
            for request in batch:
                traced.live.pop(id(request), None)
        assert picked[0] == picked[1], (flags, countdown)
    traced.tracer.close(timeout_s=1)
