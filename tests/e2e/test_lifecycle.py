"""A request's end, whichever way it comes: every request gets its access-log line and gives back
what it holds, also when its client leaves before or during the answer.

The official openai SDK is the client; it leaves by closing its stream after two events, or by
timing out while the upstream has not answered yet. The log lines are waited for (the access
log's thread writes them within its flush interval), never slept for.
"""

from __future__ import annotations

import socket
from typing import Any

import httpx
import openai
import orjson
import pytest

from velox_lab.launch import GatewayProcess

from .conftest import CLIENT_KEY, GatewayFactory, client_for, wait_for

MESSAGES = [{"role": "user", "content": "hi"}]


def access_line(gw: GatewayProcess, model: str) -> dict[str, Any] | None:
    for line in gw.log().splitlines():
        if line.startswith('{"time"'):
            record = orjson.loads(line)
            if record["model"] == model:
                return record  # type: ignore[no-any-return]
    return None


def workers_in_flight(gw: GatewayProcess) -> int:
    assert gw.admin_url is not None
    stats = httpx.get(gw.admin_url + "/stats", timeout=10).json()
    return sum(int(w["in_flight"]) for w in stats["workers"])


def test_a_client_that_leaves_mid_stream_gets_its_access_log_line(
        start_gateway: GatewayFactory) -> None:
    gw = start_gateway()
    client = client_for(gw)
    model = "leaves-mid-stream"
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, stream=True,  # type: ignore[arg-type]
        extra_headers={"x-mock-chunks": "400", "x-mock-chunk-delay-ms": "50"})
    for events, _chunk in enumerate(stream, 1):
        if events == 2:
            break
    stream.close()  # the client leaves 2 events into a 20 s stream
    line = wait_for(lambda: access_line(gw, model))
    # The answer's status, the bytes the client was given (two events at least, far from
    # all 400), and the upstream's timing: the stream had started.
    assert line["status"] == 200 and line["path"] == "/v1/chat/completions"
    assert 0 < line["bytes_out"] < 100 * 1024
    assert line["upstream_us"] is not None and line["request_id"]


def test_a_client_that_leaves_before_its_answer_gets_a_499_line(
        start_gateway: GatewayFactory) -> None:
    gw = start_gateway()
    client = client_for(gw, timeout=1.0)
    model = "leaves-before-the-answer"
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model=model, messages=MESSAGES,  # type: ignore[arg-type]
                                       extra_headers={"x-mock-latency-ms": "20000"})
    line = wait_for(lambda: access_line(gw, model))
    assert line["status"] == 499 and line["bytes_out"] == 0
    # The worker holds nothing of it any more.
    wait_for(lambda: workers_in_flight(gw) == 0)


def test_a_pipelined_http10_request_does_not_change_how_the_stream_before_it_is_framed(
        gateway: GatewayProcess) -> None:
    # An HTTP/1.1 stream, and behind it on the same connection an HTTP/1.0 request whose head
    # arrives while the stream is still to start: each answer is framed by its own request's
    # version (the stream chunked; the 1.0 answer with a length, then the connection closes).
    body = orjson.dumps({"model": "gpt-4o", "messages": MESSAGES, "stream": True})
    stream = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %b\r\n"
              b"Content-Type: application/json\r\nx-mock-chunks: 3\r\n"
              b"Content-Length: %d\r\n\r\n%b" % (CLIENT_KEY.encode(), len(body), body))
    with socket.create_connection((gateway.host, gateway.port), timeout=20) as sock:
        sock.sendall(stream + b"GET /healthz HTTP/1.0\r\n\r\n")
        received = b""
        while chunk := sock.recv(65536):  # the 1.0 answer closes the connection
            received += chunk
    first, sep, rest = received.partition(b"\r\n0\r\n\r\n")
    head = first.partition(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 200") and b"transfer-encoding: chunked" in head, received
    assert sep and first.count(b"data: ") == 4  # three events and [DONE], then the last chunk
    assert rest.startswith(b"HTTP/1.1 200 OK\r\n") and rest.endswith(b'{"status":"ok"}'), rest
