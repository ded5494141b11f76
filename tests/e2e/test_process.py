"""The process model: workers, restarts, signals, draining, and the global rate limit."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import signal
import threading
import time

import httpx
import openai
import orjson
import psutil
import pytest

from velox_lab.launch import GatewayProcess, free_port, http_get
from velox_lab.mock import MockUpstream

from .conftest import UPSTREAM_KEY, GatewayFactory, async_client_for, client_for, raw, wait_for

MESSAGES = [{"role": "user", "content": "hi"}]


def workers_of(gw: GatewayProcess) -> list[psutil.Process]:
    return psutil.Process(gw.pid).children()


def cpu_ns(pid: int) -> int:
    """CPU time of a process in nanoseconds (schedstat: finer than the 10 ms of cpu_times)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


def test_workers_are_pinned_to_distinct_cores(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_WORKERS="2")
    workers = workers_of(gw)
    assert len(workers) == 2
    cpus = len(os.sched_getaffinity(0))
    affinities = [tuple(w.cpu_affinity()) for w in workers]
    assert all(len(a) == 1 for a in affinities)
    if cpus >= 2:
        assert affinities[0] != affinities[1]


def test_a_dead_worker_is_restarted_and_the_rest_keep_serving(
        start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_WORKERS="2")
    victim = workers_of(gw)[0]
    victim.kill()
    client = client_for(gw)
    for _ in range(20):  # served meanwhile, by the survivor or the replacement
        assert client.chat.completions.create(model="m", messages=MESSAGES).choices
    workers = wait_for(lambda: len(workers_of(gw)) == 2 and workers_of(gw))
    assert victim.pid not in {w.pid for w in workers}
    assert "died with signal 9" in gw.log() and "restarting" in gw.log()
    wait_for(lambda: raw(gw).get("/readyz").status_code == 200)


def test_rate_limit_is_global_across_workers(start_gateway: GatewayFactory) -> None:
    burst = 20
    gw = start_gateway(VELOX_WORKERS="2", VELOX_RATE_LIMIT_RPM="60",
                       VELOX_RATE_LIMIT_BURST=str(burst))

    async def blast() -> list[int]:
        # Separate connections, so the kernel spreads them over both workers.
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=gw.base_url, limits=limits, timeout=20) as client:
            replies = await asyncio.gather(*[
                client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
                for _ in range(100)])
        return [r.status_code for r in replies]

    workers = workers_of(gw)
    cpu_before = [cpu_ns(w.pid) for w in workers]
    started = time.monotonic()
    statuses = asyncio.run(blast())
    elapsed = time.monotonic() - started
    cpu_used = [cpu_ns(w.pid) - before for w, before in zip(workers, cpu_before, strict=False)]
    admitted = statuses.count(200)
    assert statuses.count(429) == 100 - admitted
    # One bucket for the whole gateway: never more than burst + rate x elapsed (1 per second).
    assert burst <= admitted <= burst + int(elapsed) + 1
    # Both workers did real work in the blast (an idle worker uses well under a millisecond),
    # so a per-worker bucket would have admitted up to twice the burst.
    assert min(cpu_used) > 1_000_000, cpu_used


def test_sigterm_drains_in_flight_streams_then_exits_0(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_WORKERS="2")
    client = client_for(gw)
    stream = client.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True,
        extra_headers={"x-mock-chunks": "10", "x-mock-chunk-delay-ms": "150"})
    first = next(iter(stream))
    assert first.object == "chat.completion.chunk"
    gw.signal(signal.SIGTERM)
    rest = list(stream)  # the stream that was in flight completes
    assert len([first, *rest]) == 10
    assert rest[-1].choices[0].finish_reason == "stop"
    assert gw.wait(timeout=20) == 0
    with pytest.raises(httpx.ConnectError):
        raw(gw).get("/healthz")


def test_requests_arriving_while_draining_get_503(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_WORKERS="1")
    slow = client_for(gw)
    results: list[object] = []

    def long_call() -> None:
        results.append(slow.chat.completions.create(
            model="m", messages=MESSAGES, extra_headers={"x-mock-latency-ms": "1500"}))

    thread = threading.Thread(target=long_call)
    with httpx.Client(base_url=gw.base_url, timeout=10) as keepalive:
        assert keepalive.get("/healthz").status_code == 200  # an open keep-alive connection
        thread.start()
        time.sleep(0.3)
        gw.signal(signal.SIGTERM)
        time.sleep(0.2)
        response = keepalive.post("/v1/chat/completions", json={"model": "m", "messages": []})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "shutting_down"
        assert response.headers["connection"] == "close"
    thread.join(10)
    assert len(results) == 1  # the request in flight was still answered
    assert gw.wait(timeout=20) == 0


def test_upstream_key_never_appears_in_responses_or_logs(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_LOG_LEVEL="debug")
    client = client_for(gw)
    seen: list[str] = []
    reply = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
    seen += [str(reply.headers), reply.text]
    for headers in ({"x-mock-status": "401"}, {"x-mock-fault": "reset"}, {"x-mock-status": "500"}):
        try:
            client.chat.completions.create(model="m", messages=MESSAGES, extra_headers=headers)
        except openai.APIStatusError as exc:
            seen += [str(exc.response.headers), exc.response.text]
    seen.append(raw(gw).post("/v1/chat/completions", content=b"{bad").text)
    gw.stop()
    seen.append(gw.log())
    assert all(UPSTREAM_KEY not in text for text in seen)
    assert "Bearer" not in gw.log()


@pytest.mark.parametrize("native", ["1", "0"])
def test_the_native_paths_and_their_python_twins_serve_the_api(start_gateway: GatewayFactory,
                                                               native: str) -> None:
    gw = start_gateway(VELOX_NATIVE=native, VELOX_WORKERS="1")
    client = client_for(gw)
    assert client.chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content
    big = "x" * (3 * 1024 * 1024)  # several initial windows: exercises body flow control
    assert client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": big}]).choices[0].message.content
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert len(chunks) == 8 and chunks[-1].choices[0].finish_reason == "stop"
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="m", messages=MESSAGES,
                                       extra_headers={"x-mock-status": "429"})


def test_http1_fallback_when_upstream_offers_no_h2(start_gateway: GatewayFactory,
                                                   tmp_path) -> None:
    with MockUpstream(tls=True, alpn="http/1.1", certdir=str(tmp_path)) as mock:
        gw = start_gateway(mock=mock, VELOX_WORKERS="1")
        client = client_for(gw)
        assert client.chat.completions.create(model="m", messages=MESSAGES).choices
        chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
        assert len(chunks) >= 8
        assert {r["protocol"] for r in mock.requests(10)} == {"http/1.1"}
        assert "falling back to HTTP/1.1" in gw.log()

        async def burst() -> int:
            client = async_client_for(gw)
            replies = await asyncio.gather(*[
                client.chat.completions.create(model="m", messages=MESSAGES) for _ in range(40)])
            await client.close()
            return len(replies)

        assert asyncio.run(burst()) == 40
        # The pool grows with demand (one connection per waiting request at most), not beyond.
        assert mock.stats()["open_connections"] <= 40 + 2

        # A body far over the write slice goes out a slice per loop pass, intact, and the
        # connection serves the next request.
        text = "0123456789abcdef" * (3 * 1024 * 1024 // 16)
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})
        reply = httpx.post(f"{gw.base_url}/v1/chat/completions", content=body, timeout=30,
                           headers={"content-type": "application/json"})
        assert reply.status_code == 200
        seen = [r for r in mock.requests(5) if r["path"] == "/v1/chat/completions"][-1]
        assert seen["body_length"] == len(body)
        assert seen["body_sha256"] == hashlib.sha256(body).hexdigest()
        assert client.chat.completions.create(model="m", messages=MESSAGES).choices


@pytest.mark.parametrize(("protocol", "seen"), [("h2", "h2"), ("auto", "http/1.1")])
def test_cleartext_upstream(start_gateway: GatewayFactory, protocol: str, seen: str) -> None:
    with MockUpstream(tls=False) as mock:
        gw = start_gateway(mock=mock, VELOX_WORKERS="1", VELOX_UPSTREAM_PROTOCOL=protocol)
        assert client_for(gw).chat.completions.create(model="m", messages=MESSAGES).choices
        assert {r["protocol"] for r in mock.requests(10) if r["path"].startswith("/v1/chat")} \
            == {seen}


@pytest.mark.parametrize("native", ["1", "0"])
def test_goaway_and_stream_limits_lose_no_request(start_gateway: GatewayFactory,
                                                  tmp_path, native: str) -> None:
    with MockUpstream(tls=True, goaway_after=10, max_concurrent_streams=4,
                      certdir=str(tmp_path), latency_ms=5) as mock:
        gw = start_gateway(mock=mock, VELOX_WORKERS="1", VELOX_EGRESS_POOL_CONNECTIONS="2",
                           VELOX_NATIVE=native)

        async def many() -> list[object]:
            client = async_client_for(gw)
            replies = await asyncio.gather(*[
                client.chat.completions.create(model=f"m{i}", messages=MESSAGES)
                for i in range(120)], return_exceptions=True)
            await client.close()
            return replies

        replies = asyncio.run(many())
        assert mock.stats()["goaways_sent"] >= 10
    # Streams above the GOAWAY's last id are retried elsewhere, the others finish.
    assert [r.model for r in replies] == [f"m{i}" for i in range(120)]  # type: ignore[union-attr]


def test_lost_upstream_is_502_then_reconnected(start_gateway: GatewayFactory,
                                               tmp_path) -> None:
    port = free_port()
    mock = MockUpstream(tls=True, certdir=str(tmp_path), extra_args=["--port", str(port)]).start()
    gw = start_gateway(mock=mock, VELOX_WORKERS="1", VELOX_CONNECT_TIMEOUT_MS="500")
    client = client_for(gw)
    assert client.chat.completions.create(model="m", messages=MESSAGES).choices
    mock.stop()
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert err.value.status_code == 502
    wait_for(lambda: raw(gw).get("/readyz").status_code == 503)
    mock = MockUpstream(tls=True, certdir=str(tmp_path), extra_args=["--port", str(port)]).start()
    try:
        wait_for(lambda: raw(gw).get("/readyz").status_code == 200, timeout=15)
        assert client.chat.completions.create(model="m", messages=MESSAGES).choices
        assert "upstream connect" in gw.log()  # the failed attempts were logged
    finally:
        mock.stop()


@pytest.mark.parametrize("env", [{"VELOX_ARENA_BYTES": "0"}, {"VELOX_BATCH_MAX": "1"},
                                 {"VELOX_PIN_WORKERS": "0"}])
def test_architecture_switches_serve_the_same_api(start_gateway: GatewayFactory,
                                                  env: dict[str, str]) -> None:
    gw = start_gateway(VELOX_WORKERS="1", **env)

    async def run() -> list[str]:
        client = async_client_for(gw)
        replies = await asyncio.gather(*[
            client.chat.completions.create(model=f"m{i}", messages=MESSAGES) for i in range(50)])
        await client.close()
        return [r.model for r in replies]

    assert asyncio.run(run()) == [f"m{i}" for i in range(50)]


def test_sigint_also_drains_and_exits_0(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_WORKERS="2")
    stream = client_for(gw).chat.completions.create(
        model="m", messages=MESSAGES, stream=True,
        extra_headers={"x-mock-chunks": "6", "x-mock-chunk-delay-ms": "100"})
    first = next(iter(stream))
    # A terminal's Ctrl-C reaches the whole process group: supervisor and workers alike.
    for process in [psutil.Process(gw.pid), *workers_of(gw)]:
        # The supervisor passes the signal on too, so an idle worker may be gone already.
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGINT)
    assert len([first, *stream]) == 6
    assert gw.wait(timeout=20) == 0


def test_upstream_certificate_is_verified(start_gateway: GatewayFactory,
                                          upstream: MockUpstream) -> None:
    # Without the mock's CA the TLS handshake must fail: never ready, and calls get 502.
    gw = start_gateway(wait_ready=False, VELOX_UPSTREAM_CA_FILE="",
                       VELOX_CONNECT_TIMEOUT_MS="1000")
    wait_for(lambda: "certificate verify failed" in gw.log().lower())
    assert raw(gw).get("/readyz").status_code == 503
    with pytest.raises(openai.InternalServerError) as err:
        client_for(gw).chat.completions.create(model="m", messages=MESSAGES)
    assert err.value.status_code == 502


def test_ssl_cert_file_adds_a_trusted_ca(start_gateway: GatewayFactory,
                                         upstream: MockUpstream) -> None:
    gw = start_gateway(VELOX_UPSTREAM_CA_FILE="", SSL_CERT_FILE=upstream.ca_file or "")
    assert client_for(gw).chat.completions.create(model="m", messages=MESSAGES).choices


def test_demo_answers_an_sdk_call_and_stops_on_ctrl_c(tmp_path) -> None:
    import subprocess
    import sys

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VELOX_")}
    env["VELOX_PORT"] = str(port)
    demo = subprocess.Popen([sys.executable, "-m", "velox", "demo"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert demo.stdout is not None
        for line in demo.stdout:
            lines.append(line)
            if "Press Ctrl-C to stop" in line:
                break
        text = "".join(lines)
        assert f'OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key="sk-velox-demo")' in text
        assert "chat.completions  → 'Hello from the Velox mock upstream'" in text
        assert "streamed 6 chunks" in text
        admin = re.search(r"admin server \(/stats, /metrics, /debug/pprof/\) is on "
                          r"http://127\.0\.0\.1:(\d+)", text)
        assert admin is not None, text
        assert http_get("127.0.0.1", int(admin.group(1)), "/healthz")[0] == 200
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=30) == 0
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        assert demo.stdout is not None
        demo.stdout.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz")
