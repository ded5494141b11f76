"""The egress client head to head: Velox's upstream pool, per codec, vs httpx's HTTP/2 client.

Every contender sends the same POST /v1/chat/completions (about 400 bytes) to the bundled mock
upstream over TLS, keeping 64 requests in flight, inside a uvloop event loop, and reads each
whole response. One timed call sends `REQUESTS` requests; the figures per request are:

* `median_per_request_us`: wall time of the call / requests (the mock shares the machine, so
  this is end-to-end throughput of client + mock, not the client alone);
* `client_cpu_us_per_request`: this process's utime + stime / requests, the client's own cost,
  which is what the codec decides (median over rounds, from `time.process_time`);
* `mock_cpu_us_per_request`: the mock's share, for scale.

Contenders: `httpx` (a Task per request and httpx's pool, the generic way), then
`velox.egress.upstream.Upstream` built from `velox.config.settings.load(...)` over HTTP/2 (the
default pool of 2 connections) with the codecs h2, jh2 and framer (velox_lab.codecs), and with
VELOX_EGRESS=http1 (HTTP/1.1 keep-alive over TLS). The upstream is driven the way the worker drives
it, through minimal stand-ins for the relay's exchanges (egress `Client`s). Each pool benchmark
records `ratio_vs_httpx` (wall) and `cpu_ratio_vs_httpx` (> 1: the pool is cheaper).

Run: `.venv/bin/pytest --benchmark benches/bench_egress.py` (the whole file, httpx runs first).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import ssl
import time
from statistics import median
from typing import Any

import pytest
import uvloop

from benches.e2e.machine import tree_cpu
from velox.config.settings import load
from velox.egress.interfaces import CallHandle
from velox.egress.pool import EgressOptions
from velox.egress.upstream import Upstream
from velox_lab.codecs import factory

IN_FLIGHT = 64
REQUESTS = {"httpx": 400}
DEFAULT_REQUESTS = 3000
ROUNDS = {"httpx": 3}
DEFAULT_ROUNDS = 5
PATH = b"/v1/chat/completions"
BODY = json.dumps({"model": "gpt-4o-mini", "temperature": 0.2, "max_tokens": 64, "messages": [
    {"role": "system", "content": "You are a terse assistant. Answer in one short sentence."},
    {"role": "user", "content": "In one sentence, what does an API gateway do for an application "
                                "that calls a large language model over HTTP?"}]}).encode()
HEADERS = [(b"content-type", b"application/json"),
           (b"authorization", b"Bearer sk-bench-not-a-secret")]
_results: dict[str, dict[str, float]] = {}


class _Exchange:
    """What egress needs of relay.Exchange (an egress `Client`): count the answer, send the next."""

    __slots__ = ("driver", "attempt", "finished", "status")

    method = b"POST"
    path = PATH
    headers_out = HEADERS
    body = BODY
    paused = False

    def __init__(self, driver: _Driver) -> None:
        self.driver = driver
        self.attempt: CallHandle | None = None
        self.finished = False
        self.status = 0

    def on_response(self, status: int, headers: list, end_stream: bool) -> None:
        self.status = status
        if end_stream:
            self._finish()

    def on_data(self, data: bytes, end_stream: bool) -> None:
        if end_stream:
            self._finish()

    def on_answer(self, status: int, headers: list, body: bytes) -> None:
        self.status = status
        self._finish()

    def on_error(self, exc: BaseException) -> None:
        self.driver.errors += 1
        self._finish()

    def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.attempt = None
            self.driver.complete(self)


class _Driver:
    def __init__(self, pool: Upstream, total: int) -> None:
        self.pool, self.total = pool, total
        self.sent = self.done = self.errors = 0
        self.future: asyncio.Future[None] = pool.loop.create_future()

    def start(self) -> None:
        for _ in range(min(IN_FLIGHT, self.total)):
            self._send()
        self.pool.flush()

    def _send(self) -> None:
        self.sent += 1
        self.pool.submit(_Exchange(self))

    def complete(self, exchange: _Exchange) -> None:
        if exchange.status != 200:
            self.errors += 1
        self.done += 1
        if self.sent < self.total:
            self._send()
            self.pool.flush()  # as the worker does after each batch
        elif self.done == self.total and not self.future.done():
            self.future.set_result(None)


async def _pool_round(pool: Upstream, total: int) -> int:
    driver = _Driver(pool, total)
    driver.start()
    await driver.future
    return driver.errors


async def _httpx_round(client: Any, url: str, total: int) -> int:
    left, errors = [total], [0]
    headers = [(k.decode(), v.decode()) for k, v in HEADERS]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            response = await client.post(url, content=BODY, headers=headers)
            if response.status_code != 200:
                errors[0] += 1

    await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
    return errors[0]


@pytest.mark.parametrize("who", ["httpx", "h2", "jh2", "framer", "http1"])
def test_egress(benchmark: Any, mock_upstream: Any, who: str) -> None:
    benchmark.group = f"egress: {IN_FLIGHT} in flight to the mock over TLS, per request"
    total, rounds = REQUESTS.get(who, DEFAULT_REQUESTS), ROUNDS.get(who, DEFAULT_ROUNDS)
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    cpu: list[float] = []
    mock_cpu: list[float] = []
    errors: list[int] = []
    closer: Any
    if who == "httpx":
        import httpx

        ctx = ssl.create_default_context(cafile=mock_upstream.ca_file)
        client = httpx.AsyncClient(http2=True, verify=ctx)
        url = mock_upstream.origin + PATH.decode()
        make = lambda: _httpx_round(client, url, total)  # noqa: E731
        closer = client.aclose
    else:
        settings = load({"VELOX_UPSTREAM_ORIGIN": mock_upstream.origin,
                         "VELOX_EGRESS": "http1" if who == "http1" else "auto",
                         "VELOX_UPSTREAM_CA_FILE": mock_upstream.ca_file,
                         "VELOX_UPSTREAM_API_KEY": "sk-bench-not-a-secret"}, dotenv=None)
        assert settings.tables is not None
        options = EgressOptions.from_settings(settings)
        if who != "http1":
            options = dataclasses.replace(options, codec=factory(who))
        pool = Upstream(settings.tables.upstreams[0], options, loop)
        pool.start()

        async def ready() -> None:
            for _ in range(1000):
                if pool.ready:
                    return
                await asyncio.sleep(0.01)
            raise RuntimeError(f"the {who} pool did not become ready")

        loop.run_until_complete(ready())
        make = lambda: _pool_round(pool, total)  # noqa: E731
        closer = pool.close

    def one_round() -> None:
        # process_time has nanosecond resolution; /proc (for the mock) counts 10 ms ticks, so
        # the mock's share is taken over all measured rounds together.
        t0, m0 = time.process_time(), tree_cpu([mock_upstream.pid])
        errors.append(loop.run_until_complete(make()))
        cpu.append(time.process_time() - t0)
        mock_cpu.append(tree_cpu([mock_upstream.pid]) - m0)

    try:
        benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=1)
    finally:
        loop.run_until_complete(closer())
        loop.close()
        asyncio.set_event_loop(None)
    measured = cpu[1:]  # the first entry is the warm-up round
    per = {"wall": benchmark.stats.stats.median / total * 1e6,
           "cpu": median(measured) / total * 1e6,
           "mock": sum(mock_cpu[1:]) / (total * len(mock_cpu[1:])) * 1e6}
    _results[who] = per
    benchmark.extra_info.update({
        "requests_per_call": total, "in_flight": IN_FLIGHT, "errors": sum(errors),
        "median_per_request_us": round(per["wall"], 2),
        "client_cpu_us_per_request": round(per["cpu"], 2),
        "mock_cpu_us_per_request": round(per["mock"], 2),
    })
    base = _results.get("httpx")
    if who != "httpx" and base:
        benchmark.extra_info["ratio_vs_httpx"] = round(base["wall"] / per["wall"], 2)
        benchmark.extra_info["cpu_ratio_vs_httpx"] = round(base["cpu"] / per["cpu"], 2)
    assert sum(errors) == 0
