"""What parsing a client request costs ingress, and how much of it is httptools' per-header
Python callbacks (pytest-benchmark, group "ingress-parse"; issue 12's parser decision).

Two realistic requests, fed whole as one read:

* `wrk`: the end-to-end benchmark's request (wrk's Host, Content-Type, Authorization and
  Content-Length, a 300-byte chat body): 4 header fields;
* `sdk`: what the official `openai` Python SDK sends (host, accept-encoding, connection,
  accept, content-type, user-agent, eight x-stainless-* fields, authorization,
  content-length, the same body): 16 header fields.

Contenders, each parsing one request per call of the inner loop:

* `ingress`:       velox's ClientConnection.data_received on VELOX_INGRESS_PARSER=httptools
                   (httptools with ingress's callbacks: header collection and limits, routing,
                   auth, the Request pushed on a ring);
* `ingress-native`: the same on VELOX_INGRESS_PARSER=native (the default): the head parsed by
                   one call of the native request-head parser, the body taken by its length;
* `reqhead`:       that native call alone (`_native.reqhead`: the head parsed and validated, the
                   header list built) plus slicing the body out: what the native path's parse
                   costs, to compare with `callbacks` and `no-header-cb`;
* `callbacks`:     httptools with minimal Python callbacks (url, every header appended to a
                   list, body, completion): the parse plus the price of the callbacks;
* `no-header-cb`:  httptools with no on_header callback (url, body, completion only): llhttp's
                   C parse plus the three callbacks any design keeps; what a native request
                   assembler could approach (it would add building the header tuples in C);
* `h11`:           h11 (pure Python, well kept), for scale.

`extra_info` records per-request microseconds and the per-header share: (callbacks -
no-header-cb) / fields is what one header's Python callback costs.

`test_pipeline_cpu_per_request` measures the whole socket-free worker path
(velox_lab/pipeline.py: 64 clients sending the SDK's request, native codec) on both parsers,
in interleaved blocks on the thread CPU clock, and records the per-request CPU of each and the
difference (issue 12's parser decision).

Run: `.venv/bin/pytest --benchmark benches/bench_ingress.py` (the whole file: the shares are
computed once every contender of a request has run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import h11
import httptools
import pytest

from benches.e2e import workload
from velox import _native
from velox.config.settings import load
from velox.ingress.arena import Arena
from velox.ingress.auth import Auth
from velox.ingress.connection import ClientConnection, IngressState
from velox_lab.pipeline import FakeTransport, Pipeline

BODY = workload.body()
REQUESTS = {
    "wrk": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n"
            b"Content-Type: application/json\r\nAuthorization: Bearer sk-bench-not-a-secret\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(BODY), BODY)),
    "sdk": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n"
            b"Accept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\n"
            b"Accept: application/json\r\nContent-Type: application/json\r\n"
            b"User-Agent: OpenAI/Python 1.54.4\r\nX-Stainless-Lang: python\r\n"
            b"X-Stainless-Package-Version: 1.54.4\r\nX-Stainless-OS: Linux\r\n"
            b"X-Stainless-Arch: x64\r\nX-Stainless-Runtime: CPython\r\n"
            b"X-Stainless-Runtime-Version: 3.11.7\r\nX-Stainless-Retry-Count: 0\r\n"
            b"X-Stainless-Read-Timeout: 600\r\n"
            b"Authorization: Bearer sk-proj-a1B2c3D4e5F6g7H8a1B2c3D4e5F6g7H8\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(BODY), BODY)),
}
FIELDS = {name: raw.split(b"\r\n\r\n", 1)[0].count(b"\r\n") for name, raw in REQUESTS.items()}
LOOPS = 200  # requests per timed call
_us: dict[tuple[str, str], float] = {}


class _Ring:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def try_push(self, request: Any) -> bool:
        self.n += 1
        return True


def _ingress(parser: str = "httptools") -> Callable[[bytes], None]:
    state = IngressState(None, _Ring(), lambda: None, Arena(0),  # type: ignore[arg-type]
                         Auth(load({}, dotenv=None)), 16 << 20, 64 << 10, lambda: True,
                         None, parser == "native")
    conn = ClientConnection(state)
    conn.connection_made(FakeTransport())  # type: ignore[arg-type]
    feed, finish = conn.data_received, conn._finish

    def one(data: bytes) -> None:
        feed(data)
        finish(True)  # the answer went out: the next request is dispatched at once

    return one


def _reqhead() -> Callable[[bytes], None]:
    reqhead = _native.reqhead

    def one(data: bytes) -> None:
        head = reqhead(data, 0, 64 << 10)
        end, length = head[8], head[3]
        data[end:end + length]  # the body, as ingress takes it

    return one


class _Callbacks:
    """httptools with every callback a request parser needs, each as cheap as Python gets."""

    __slots__ = ("url", "headers", "body", "done")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.done = 0

    def on_message_begin(self) -> None:
        self.headers = []
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done += 1


class _NoHeaders:
    __slots__ = ("url", "body", "done")

    def __init__(self) -> None:
        self.url = b""
        self.body: list[bytes] = []
        self.done = 0

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done += 1


def _httptools(proto: Any) -> Callable[[bytes], None]:
    return httptools.HttpRequestParser(proto).feed_data


def _h11() -> Callable[[bytes], None]:
    conn = h11.Connection(h11.SERVER)

    def one(data: bytes) -> None:
        conn.receive_data(data)
        while True:
            event = conn.next_event()
            if isinstance(event, h11.EndOfMessage):
                break
            if event is h11.NEED_DATA:
                raise AssertionError("incomplete request")
        # Answer, as a server must before h11 parses the next request.
        conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
        conn.send(h11.EndOfMessage())
        conn.start_next_cycle()

    return one


CONTENDERS: dict[str, Callable[[], Callable[[bytes], None]]] = {
    "ingress": _ingress,
    "ingress-native": lambda: _ingress("native"),
    "reqhead": _reqhead,
    "callbacks": lambda: _httptools(_Callbacks()),
    "no-header-cb": lambda: _httptools(_NoHeaders()),
    "h11": _h11,
}


@pytest.mark.benchmark(group="ingress-parse")
@pytest.mark.parametrize("request_name", list(REQUESTS))
@pytest.mark.parametrize("contender", list(CONTENDERS))
def test_parse_one_request(benchmark: Any, contender: str, request_name: str) -> None:
    data = REQUESTS[request_name]
    one = CONTENDERS[contender]()
    for _ in range(50):  # warm-up, and proof the request parses completely
        one(data)

    def run() -> None:
        for _ in range(LOOPS):
            one(data)

    benchmark.pedantic(run, rounds=30, iterations=1, warmup_rounds=2)
    stats = benchmark.stats.stats
    # The minimum as well as the median: on a shared machine the median carries other
    # people's load, the minimum is the least disturbed round (the shares use it).
    us, us_min = stats.median / LOOPS * 1e6, stats.min / LOOPS * 1e6
    _us[(contender, request_name)] = us_min
    benchmark.extra_info["per_request_us_median"] = round(us, 3)
    benchmark.extra_info["per_request_us_min"] = round(us_min, 3)
    benchmark.extra_info["header_fields"] = FIELDS[request_name]
    cb, floor = _us.get(("callbacks", request_name)), _us.get(("no-header-cb", request_name))
    if contender == "h11" and cb is not None and floor is not None:
        # Measured last for each request (parametrize order): the shares of the others.
        benchmark.extra_info["header_callbacks_us"] = round(cb - floor, 3)
        benchmark.extra_info["per_header_callback_ns"] = round(
            (cb - floor) / FIELDS[request_name] * 1000, 1)
        ingress = _us.get(("ingress", request_name))
        if ingress is not None:
            benchmark.extra_info["ingress_over_floor_us"] = round(ingress - floor, 3)
        native = _us.get(("ingress-native", request_name))
        if ingress is not None and native is not None:
            benchmark.extra_info["ingress_native_saves_us"] = round(ingress - native, 3)


PIPELINE_BLOCKS = 30  # interleaved blocks per parser
PIPELINE_ROUNDS = 10  # rounds of 64 requests per block


@pytest.mark.benchmark(group="ingress-pipeline")
def test_pipeline_cpu_per_request(benchmark: Any) -> None:
    """Per-request CPU of the socket-free worker path on both parsers, interleaved."""
    import gc
    import statistics
    import time

    pipes = {parser: Pipeline(clients=64, codec="native", ingress_native=parser == "native")
             for parser in ("native", "httptools")}
    for pipe in pipes.values():
        for _ in range(50):
            pipe.round()
    gc.collect()
    gc.freeze()
    try:
        blocks: dict[str, list[float]] = {parser: [] for parser in pipes}
        order = list(pipes)
        for block in range(PIPELINE_BLOCKS):
            for parser in order if block % 2 else order[::-1]:  # alternate who goes first
                pipe = pipes[parser]
                t0 = time.thread_time()
                for _ in range(PIPELINE_ROUNDS):
                    pipe.round()
                blocks[parser].append((time.thread_time() - t0) / (PIPELINE_ROUNDS * 64) * 1e6)
        native = pipes["native"]
        benchmark.pedantic(native.round, rounds=20, iterations=1, warmup_rounds=2)
    finally:
        gc.unfreeze()
    for parser, us in blocks.items():
        benchmark.extra_info[f"{parser}_us_per_request_median"] = round(statistics.median(us), 2)
        benchmark.extra_info[f"{parser}_us_per_request_min"] = round(min(us), 2)
    # Paired by block: each block of one parser against the other's block next to it.
    saved = [h - n for h, n in zip(blocks["httptools"], blocks["native"], strict=False)]
    benchmark.extra_info["native_saves_us_median"] = round(statistics.median(saved), 2)
    for pipe in pipes.values():
        assert pipe.responses_written() > 0
