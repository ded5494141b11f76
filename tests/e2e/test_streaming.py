"""Streaming: chunks relayed as they arrive, and a client that leaves cancels the upstream."""

from __future__ import annotations

import socket
import time

import orjson

from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

from .conftest import client_for

MESSAGES = [{"role": "user", "content": "hi"}]


def test_chunks_arrive_as_the_upstream_sends_them(gateway: GatewayProcess) -> None:
    stream = client_for(gateway).chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True,
        extra_headers={"x-mock-chunks": "4", "x-mock-chunk-delay-ms": "300"})
    arrivals = []
    for _chunk in stream:
        arrivals.append(time.monotonic())
    # Buffering would deliver them together at the end; relayed, they keep the upstream's pace
    # (0.9 s from first to last).
    assert len(arrivals) == 4 and arrivals[-1] - arrivals[0] > 0.45


def test_client_disconnect_cancels_the_upstream_stream(gateway: GatewayProcess,
                                                       upstream: MockUpstream) -> None:
    before = upstream.stats()["streams_cancelled"]
    body = orjson.dumps({"model": "gpt-4o", "messages": MESSAGES, "stream": True})
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
               b"Content-Type: application/json\r\nx-mock-chunks: 200\r\n"
               b"x-mock-chunk-delay-ms: 50\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    sock = socket.create_connection((gateway.host, gateway.port), timeout=5)
    sock.sendall(request)
    received = b""
    while received.count(b"data: ") < 2:  # the stream is flowing
        received += sock.recv(65536)
    sock.close()
    left_at = time.monotonic()
    # 200 chunks x 50 ms would take 10 s; the cancel must reach the upstream long before.
    deadline = left_at + 3
    while upstream.stats()["streams_cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert upstream.stats()["streams_cancelled"] == before + 1
    log = [r for r in upstream.requests(20) if r["path"] == "/v1/chat/completions"]
    assert log[-1]["cancelled"] is True


def test_512_concurrent_streams_all_complete(gateway: GatewayProcess) -> None:
    import asyncio

    from .conftest import async_client_for

    async def run() -> list[int]:
        client = async_client_for(gateway, timeout=60)

        async def one(i: int) -> int:
            stream = await client.chat.completions.create(
                model=f"m{i}", messages=MESSAGES, stream=True,
                extra_headers={"x-mock-chunks": "5", "x-mock-chunk-delay-ms": "20"})
            return sum([1 async for c in stream if c.object == "chat.completion.chunk"])

        counts = await asyncio.gather(*[one(i) for i in range(512)])
        await client.close()
        return counts

    assert asyncio.run(run()) == [5] * 512
