"""How soon does the upstream hear that a streaming client left? (target: within 100 ms)

A real gateway (2 workers) in front of the mock upstream over HTTP/2 + TLS. Each round opens a
streamed chat completion that would run for 4 s (200 chunks, 20 ms apart), reads until two
events have arrived, then closes the socket. The mock stamps the moment the RST_STREAM for that
stream reaches it (`cancelled_at` in its request log, wall clock, same machine); the latency is
that stamp minus the moment the client closed. Rounds alternate between an idle gateway and one
carrying 32 other long streams, since a busy worker is when a late cancel would cost most.

Run: `pytest --benchmark benches/bench_cancel.py -s`.
"""

from __future__ import annotations

import socket
import statistics
import tempfile
import time

import orjson

from velox_lab.closedloop import chat_request
from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

ROUNDS = 40
BACKGROUND = 32
_STREAM = orjson.dumps({"model": "gpt-4o-mini", "stream": True,
                        "messages": [{"role": "user", "content": "Count to 200"}]})


def _open_stream(port: int, chunks: int, delay_ms: int, tag: str = "") -> socket.socket:
    extra = b"x-mock-chunks: %d\r\nx-mock-chunk-delay-ms: %d\r\n" % (chunks, delay_ms)
    if tag:  # forwarded upstream like any end-to-end header: how we find our stream's record
        extra += b"x-bench-tag: %s\r\n" % tag.encode()
    request = chat_request(_STREAM).replace(b"\r\n\r\n", b"\r\n" + extra + b"\r\n", 1)
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(request)
    return sock


def _read_events(sock: socket.socket, n: int) -> None:
    received = b""
    while received.count(b"data: ") < n:
        chunk = sock.recv(65536)
        assert chunk, "the stream ended early"
        received += chunk


def _cancel_once(gw: GatewayProcess, mock: MockUpstream, tag: str) -> float:
    """Milliseconds from the client's close to the upstream's receipt of the reset."""
    sock = _open_stream(gw.port, 200, 20, tag)
    _read_events(sock, 2)
    closed_at = time.time()
    sock.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for entry in mock.requests(2 * BACKGROUND + 8):
            if ["x-bench-tag", tag] in entry["headers"] and entry["cancelled_at"]:
                return (entry["cancelled_at"] - closed_at) * 1e3
        time.sleep(0.002)
    raise AssertionError("the upstream never saw the cancel")


def test_client_disconnect_cancel_latency(benchmark) -> None:
    results: dict[str, list[float]] = {"idle": [], "busy": []}
    with MockUpstream(tls=True, certdir=tempfile.mkdtemp()) as mock:
        env = {"VELOX_UPSTREAM_ORIGIN": mock.origin, "VELOX_UPSTREAM_CA_FILE": mock.ca_file or "",
               "VELOX_WORKERS": "2", "VELOX_UPSTREAM_API_KEY": "sk-bench",
               "VELOX_ACCESS_LOG": "0", "VELOX_RATE_LIMIT_RPM": "0"}
        with GatewayProcess(env) as gw:

            def measure() -> None:
                for r in range(ROUNDS):
                    busy = r % 2 == 1
                    background = [_open_stream(gw.port, 100, 40) for _ in range(BACKGROUND)] \
                        if busy else []
                    try:
                        for sock in background:
                            _read_events(sock, 1)
                        results["busy" if busy else "idle"].append(
                            _cancel_once(gw, mock, f"round-{r}"))
                    finally:
                        for sock in background:
                            sock.close()
                    time.sleep(0.2)  # let the background cancels settle before the next round

            benchmark.group = "client disconnect: time until the upstream sees RST_STREAM"
            benchmark.pedantic(measure, rounds=1, iterations=1)
    for kind, values in results.items():
        values.sort()
        benchmark.extra_info.update({
            f"{kind}_p50_ms": round(statistics.median(values), 2),
            f"{kind}_p90_ms": round(values[int(0.9 * len(values))], 2),
            f"{kind}_max_ms": round(values[-1], 2), f"{kind}_n": len(values)})
    print("\n" + "; ".join(f"{k}: p50 {benchmark.extra_info[f'{k}_p50_ms']} ms, p90 "
                           f"{benchmark.extra_info[f'{k}_p90_ms']} ms, max "
                           f"{benchmark.extra_info[f'{k}_max_ms']} ms" for k in results))
