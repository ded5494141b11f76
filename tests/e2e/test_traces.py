"""Traces of real requests: a gateway of two workers (VELOX_OTEL_ENDPOINT) in front of mock
upstreams, the openai SDK as the client, and a real OTLP/HTTP receiver in the test decoding
what the official exporter sends.

* A request retried twice (two upstreams answering 503, the third 200) gives one SERVER span
  and three CLIENT spans with the GenAI attributes, in the client's trace (its traceparent),
  each attempt sending upstream a traceparent that names its own client span; a stream too.
* A cached route: the miss has its attempt, the hit a server span alone (`velox.cache`).
* VELOX_OTEL_SAMPLE=0: nothing exported; an upstream call carries a traceparent only when its
  client sent one (the client's trace id, a span of ours, the sampled flag as the client's);
  a client's sampled traceparent is still followed.
* A collector whose port is closed, or one that accepts and never answers: every request is
  answered, the spans dropped are counted in /metrics, and the gateway stops in time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e import test_batching as batching
from tests.e2e import test_routing as routing
from tests.e2e.conftest import CLIENT_KEY, client_for, wait_for
from tests.e2e.test_routing import KEYS, upstream_table, write_config
from tests.otlp import CLIENT, SERVER, Receiver, closed_port, silent_collector
from velox.spend.trace import parse_traceparent
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SAMPLED = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
PROMPT = "a prompt that must never reach a span"
# Spans leave each worker within 50 ms (the SDK's own variable, as an operator would set it).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


# The routing tests' fixtures: three mocks (a, b, c) reset before each test, the gateways' list.
certdir, mocks, fresh, gateways = routing.certdir, routing.mocks, routing.fresh, routing.gateways


ROUTE_M = """
[[route]]
model = "m"
targets = [{ upstream = "a" }, { upstream = "b", priority = 1 }, { upstream = "c", priority = 2 }]

[[price]]
model = "m"
input = 1.0
output = 2.0
"""


def _gateway(tmp_path: Path, gateways: list[GatewayProcess], fresh: dict[str, MockUpstream],
             routes: str = ROUTE_M, **env: str) -> GatewayProcess:
    """By default route "m": a, then b, then c (priorities), each tried once before the next."""
    config = write_config(tmp_path, "".join(upstream_table(n, fresh[n]) for n in "abc") + routes)
    gw = GatewayProcess({
        "VELOX_CONFIG": str(config), "VELOX_WORKERS": "2", "VELOX_RATE_LIMIT_RPM": "0",
        "VELOX_SHUTDOWN_GRACE_S": "5", "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}",
        **KEYS, **FAST_EXPORT, **env}, log_path=tmp_path / f"velox-{len(gateways)}.log")
    gateways.append(gw)
    return gw.start(wait_ready=True)


@pytest.fixture
def traced(tmp_path: Path, fresh: dict[str, MockUpstream], receiver: Receiver,
           gateways: list[GatewayProcess]) -> Callable[..., GatewayProcess]:
    """Starts a gateway of route "m" exporting its traces to the test's receiver."""
    def start(routes: str = ROUTE_M, **env: str) -> GatewayProcess:
        return _gateway(tmp_path, gateways, fresh, routes,
                        VELOX_OTEL_ENDPOINT=receiver.endpoint, **env)

    return start


def _traceparents(mock: MockUpstream) -> list[str]:
    """The traceparent of each chat call the mock received, in order."""
    return [dict(r["headers"]).get("traceparent", "") for r in mock.requests(limit=50)
            if r["path"].startswith("/v1/chat/completions")]


def _counter(gw: GatewayProcess, name: str) -> float:
    status, body = gw.admin_get("/metrics")
    assert status == 200
    return sum(s.value for f in text_string_to_metric_families(body.decode())
               for s in f.samples if s.name == name)


def test_a_retried_request_gives_a_server_span_and_a_client_span_per_attempt(
        traced: Callable[..., GatewayProcess], fresh: dict[str, MockUpstream],
        receiver: Receiver) -> None:
    fresh["a"].behave(status=503)
    fresh["b"].behave(status=503)
    gw = traced()
    client = client_for(gw)
    answer = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPT}],
        extra_headers={"traceparent": SAMPLED})
    assert answer.choices[0].message.content
    spans = receiver.wait_for(4)
    servers = [s for s in spans if s["kind"] == SERVER]
    clients = sorted((s for s in spans if s["kind"] == CLIENT), key=lambda s: s["start"])
    assert len(servers) == 1 and len(clients) == 3, spans
    server = servers[0]
    assert server["name"] == "chat m"
    assert server["trace_id"] == CLIENT_TRACE and server["parent"] == CLIENT_SPAN
    attrs = server["attrs"]
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "m"
    assert attrs["http.response.status_code"] == 200 and attrs["velox.attempts"] == 3
    assert attrs["gen_ai.response.model"] == answer.model
    assert attrs["gen_ai.usage.input_tokens"] == answer.usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == answer.usage.completion_tokens
    assert attrs["gen_ai.response.finish_reasons"] == [answer.choices[0].finish_reason]
    assert [e[0] for e in server["events"]] == ["velox.queued", "velox.parsed", "velox.limits"]
    # Which route answered and what it cost (USD 1 and 2 per million tokens in and out).
    assert attrs["velox.route"] == "m"
    assert attrs["velox.cost_usd"] == pytest.approx(
        (answer.usage.prompt_tokens + 2 * answer.usage.completion_tokens) / 1e6)
    for span, name in zip(clients, "abc", strict=True):
        a = span["attrs"]
        assert span["trace_id"] == CLIENT_TRACE and span["parent"] == server["span_id"]
        assert a["velox.upstream"] == name and a["gen_ai.provider.name"] == "openai"
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "m"
        assert a["server.address"] == "127.0.0.1" and a["server.port"] == fresh[name].port
        assert span["start"] <= span["end"]
        # The upstream saw a traceparent naming this attempt's span, in the client's trace.
        sent = parse_traceparent(_traceparents(fresh[name])[-1])
        assert sent is not None and sent.sampled
        assert (f"{sent.trace_id:032x}", f"{sent.span_id:016x}") == (CLIENT_TRACE,
                                                                     span["span_id"])
    for failed in clients[:2]:
        assert failed["attrs"]["error.type"] == "503" and failed["status"] == 2  # ERROR
        assert failed["attrs"]["http.response.status_code"] == 503
    last = clients[2]["attrs"]
    assert "error.type" not in last and last["http.response.status_code"] == 200
    assert last["gen_ai.usage.output_tokens"] == answer.usage.completion_tokens
    assert last["gen_ai.response.finish_reasons"] == [answer.choices[0].finish_reason]
    # Contents are never recorded.
    assert not any(PROMPT in str(v) for s in spans for v in s["attrs"].values())

    # A stream (with usage, as the SDK asks for it), in a trace of its own: the gateway starts
    # one, the upstream sees it.
    fresh["a"].behave()
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    usage = next(c.usage for c in chunks if c.usage is not None)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices
              and c.choices[0].finish_reason]
    spans = receiver.wait_for(6)[4:]
    server = next(s for s in spans if s["kind"] == SERVER)
    one = next(s for s in spans if s["kind"] == CLIENT)
    assert server["trace_id"] != CLIENT_TRACE and server["parent"] == ""
    assert one["attrs"]["velox.upstream"] == "a"
    assert one["attrs"]["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert one["attrs"]["gen_ai.response.finish_reasons"] == finish
    sent = parse_traceparent(_traceparents(fresh["a"])[-1])
    assert sent is not None and f"{sent.span_id:016x}" == one["span_id"]
    assert f"{sent.trace_id:032x}" == server["trace_id"]
    wait_for(lambda: _counter(gw, "velox_trace_spans_exported_total") == 6)
    assert _counter(gw, "velox_trace_spans_dropped_total") == 0


def test_a_cache_hit_is_a_server_span_without_attempts(
        traced: Callable[..., GatewayProcess], receiver: Receiver) -> None:
    gw = traced(VELOX_CACHE="1")
    client = client_for(gw)
    messages = [{"role": "user", "content": "the same question twice"}]
    first = client.chat.completions.with_raw_response.create(model="m", messages=messages)
    second = client.chat.completions.with_raw_response.create(model="m", messages=messages)
    # The cache records the answer through tracing's observer, and serves it.
    assert (first.headers["x-velox-cache"], second.headers["x-velox-cache"]) == ("miss", "hit")
    assert second.parse().model_dump() == first.parse().model_dump()
    spans = receiver.wait_for(3)
    miss, hit = sorted((s for s in spans if s["kind"] == SERVER), key=lambda s: s["start"])
    (attempt,) = [s for s in spans if s["kind"] == CLIENT]
    assert attempt["parent"] == miss["span_id"]
    assert [(e[0], e[2]) for e in miss["events"] if e[0] == "velox.cache"] == [
        ("velox.cache", {"velox.cache.hit": False})]
    assert [(e[0], e[2]) for e in hit["events"] if e[0] == "velox.cache"] == [
        ("velox.cache", {"velox.cache.hit": True})]
    assert miss["attrs"]["velox.cache.hit"] is False and hit["attrs"]["velox.cache.hit"] is True
    assert hit["attrs"]["velox.attempts"] == 0 and hit["attrs"]["http.response.status_code"] == 200


def test_sample_0_exports_nothing_and_still_propagates(
        traced: Callable[..., GatewayProcess], fresh: dict[str, MockUpstream],
        receiver: Receiver) -> None:
    gw = traced(VELOX_OTEL_SAMPLE="0")
    client = client_for(gw)
    messages = [{"role": "user", "content": "hi"}]
    for _ in range(20):  # over both workers
        client.chat.completions.create(model="m", messages=messages)
    unsampled = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"
    client.chat.completions.create(model="m", messages=messages,
                                   extra_headers={"traceparent": unsampled})
    sent = [parse_traceparent(t) for t in _traceparents(fresh["a"])]
    # Unsampled and no client's trace: nothing of ours upstream (its side decides).
    assert len(sent) == 21 and sent[:20] == [None] * 20
    assert sent[-1] is not None and not sent[-1].sampled
    assert f"{sent[-1].trace_id:032x}" == CLIENT_TRACE
    assert sent[-1].span_id != int(CLIENT_SPAN, 16)  # the gateway's span, not the client's
    # A client's sampled trace is followed even at 0: the only spans exported.
    client.chat.completions.create(model="m", messages=messages,
                                   extra_headers={"traceparent": SAMPLED})
    spans = receiver.wait_for(2)
    wait_for(lambda: _counter(gw, "velox_trace_spans_exported_total") == 2)
    assert len(receiver.spans) == 2 and {s["trace_id"] for s in spans} == {CLIENT_TRACE}


def test_a_merged_batch_call_is_one_client_span_linked_from_each_member(
        traced: Callable[..., GatewayProcess], fresh: dict[str, MockUpstream],
        receiver: Receiver) -> None:
    """One worker, so the members meet: a slow first request of the group goes out alone,
    and three more wait behind it and leave as one merged call (max_requests = 3)."""
    gw = traced(routes="""
[[route]]
model = "emb"
targets = [{ upstream = "a" }]
batch = { max_requests = 3, max_wait_ms = 5000 }
""", VELOX_WORKERS="1")
    texts = ["the first member", "the second", "a third member's text"]

    async def run() -> list[Any]:
        first = await batching.blocker(gw, fresh["a"], "emb", "traced")
        c = batching.client(gw)
        members = await asyncio.gather(*(c.embeddings.create(
            model="emb", input=t, user="traced", encoding_format="float") for t in texts))
        await first
        return members

    answers = batching.arun(run())
    merged = [r for r in fresh["a"].requests(limit=50)
              if r["path"] == batching.EMBED and r["inputs"] == 3]
    assert len(merged) == 1, "the three members did not leave as one call"
    # The blocker: a server span and its attempt; the members: a server span each; the
    # merged call: one client span.
    spans = receiver.wait_for(6)
    (call,) = [s for s in spans if s["kind"] == CLIENT and s["parent"] == ""]
    servers = {s["span_id"]: s for s in spans if s["kind"] == SERVER}
    members = [s for s in servers.values() if s["links"]]
    assert len(servers) == 4 and len(members) == 3, spans
    assert call["name"] == "embeddings emb" and call["attrs"]["velox.batch.members"] == 3
    assert call["attrs"]["gen_ai.operation.name"] == "embeddings"
    assert call["attrs"]["velox.upstream"] == "a"
    assert call["attrs"]["http.response.status_code"] == 200
    assert call["attrs"]["gen_ai.usage.input_tokens"] == sum(
        a.usage.prompt_tokens for a in answers)
    # Each member links to the call's span, and the call to each member's server span.
    assert sorted(call["links"]) == sorted((m["trace_id"], m["span_id"]) for m in members)
    for member in members:
        assert member["links"] == [(call["trace_id"], call["span_id"])]
        assert member["trace_id"] != call["trace_id"]
        assert member["attrs"]["velox.attempts"] == 0
        assert member["attrs"]["gen_ai.operation.name"] == "embeddings"
    assert sorted(m["attrs"]["gen_ai.usage.input_tokens"] for m in members) == sorted(
        a.usage.prompt_tokens for a in answers)
    # The upstream saw the merged call in the call's trace, naming the call's span.
    sent = parse_traceparent(dict(merged[0]["headers"]).get("traceparent", ""))
    assert sent is not None and sent.sampled
    assert (f"{sent.trace_id:032x}", f"{sent.span_id:016x}") == (call["trace_id"],
                                                                 call["span_id"])
    # The blocker went alone: a request like any other, its attempt a child of its span.
    (alone,) = [s for s in servers.values() if not s["links"]]
    (attempt,) = [s for s in spans if s["kind"] == CLIENT and s["parent"]]
    assert attempt["parent"] == alone["span_id"] and not attempt["links"]


@pytest.mark.parametrize("collector", ["closed", "silent"])
def test_a_dead_collector_costs_no_request_anything(
        collector: str, tmp_path: Path, fresh: dict[str, MockUpstream],
        gateways: list[GatewayProcess]) -> None:
    held = None
    if collector == "closed":
        endpoint = f"http://127.0.0.1:{closed_port()}"
    else:
        listener, _accepted, held, acceptor = silent_collector()
        endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        # A small queue and export timeout, so the drops come within a few hundred requests.
        gw = _gateway(tmp_path, gateways, fresh, VELOX_OTEL_ENDPOINT=endpoint,
                      OTEL_BSP_MAX_QUEUE_SIZE="32", OTEL_BSP_MAX_EXPORT_BATCH_SIZE="16",
                      OTEL_EXPORTER_OTLP_TIMEOUT="2")
        codes = asyncio.run(_fire(gw.base_url, 400, 16))
        assert codes == [200] * 400
        wait_for(lambda: _counter(gw, "velox_trace_spans_dropped_total") >= 400, timeout=60)
        assert _counter(gw, "velox_trace_spans_exported_total") == 0
        assert gw.stop(timeout=30) == 0  # the exit is not held by the exporter
    finally:
        if held is not None:
            listener.close()
            acceptor.join(5)
            for conn in held:
                conn.close()


async def _fire(base_url: str, total: int, concurrency: int) -> list[int]:
    """`total` chat calls over `concurrency` connections; their status codes."""
    codes: list[int] = []
    left = list(range(total))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    async def one() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=30, headers={
                "authorization": f"Bearer {CLIENT_KEY}"}) as client:
            while left:
                left.pop()
                codes.append((await client.post("/v1/chat/completions", json=body)).status_code)

    await asyncio.gather(*(one() for _ in range(concurrency)))
    return codes
