"""One worker's whole request path, driven without sockets.

`Pipeline` wires the real ingress, ring, worker stages, egress pool, HTTP/2 connection and codec
and relay together exactly as a worker does, but gives every connection a `FakeTransport` and
the worker a `FakeLoop` whose callbacks run when `run_ready()` is called. A round feeds one
HTTP/1.1 request into each client connection, drains (parse, rate limit, route, frame
building, one write per upstream connection), answers every open upstream stream with canned
HTTP/2 frames, and lets the relay write the client responses. What remains is what Python
spends per request; the kernel's share (loopback sockets, TLS) is what this leaves out.

`codec` names the HTTP/2 codec of the upstream connection (velox_lab.codecs): "native" runs
the gateway as configured by default, "framer" with VELOX_NATIVE=0 (every Python twin: the
framer, httptools alone for request heads, the Python response writer), "h2" and "jh2" the
default gateway with a comparison codec on that connection.

Used by the benchmarks (benches/bench_pipeline.py: the per-request cost; pipeline_ab.py) and by
the tests (the answer bytes, no reference cycles on the hot path). Also the canned requests both
send: CLIENT_REQUEST (the OpenAI SDK's head and a short chat body) and REQUESTS (what wrk and
the SDK send for the benchmarks' workload).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import orjson

from velox.admission.ratelimit import Limiter
from velox.config.settings import load
from velox.egress.h2conn import H2Connection, State
from velox.ingress.connection import ClientConnection
from velox.pipeline.worker import Worker
from velox.state.stats import SharedStats
from velox_lab.codecs import make_codec

CHAT_BODY = orjson.dumps({
    "model": "gpt-4o-mini",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant that answers briefly."},
        {"role": "user", "content": "Say hello to the benchmark, politely and briefly please."},
    ],
    "max_tokens": 32,
    "temperature": 0.2,
    "user": "bench-user-0001",
})
# What the OpenAI Python SDK sends (its x-stainless-* headers included).
CLIENT_REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\n"
    b"Host: 127.0.0.1:8080\r\n"
    b"Accept-Encoding: gzip, deflate\r\n"
    b"Connection: keep-alive\r\n"
    b"Accept: application/json\r\n"
    b"Content-Type: application/json\r\n"
    b"User-Agent: OpenAI/Python 1.54.0\r\n"
    b"X-Stainless-Lang: python\r\n"
    b"X-Stainless-Package-Version: 1.54.0\r\n"
    b"X-Stainless-OS: Linux\r\n"
    b"X-Stainless-Arch: x64\r\n"
    b"X-Stainless-Runtime: CPython\r\n"
    b"X-Stainless-Runtime-Version: 3.11.7\r\n"
    b"Authorization: Bearer sk-client-0123456789abcdef\r\n"
    b"X-Stainless-Retry-Count: 0\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(CHAT_BODY), CHAT_BODY)
)
REPLY_BODY = orjson.dumps({
    "id": "chatcmpl-0123456789", "object": "chat.completion", "created": 1760000000,
    "model": "gpt-4o-mini",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "Hello, benchmark!"}}],
    "usage": {"prompt_tokens": 31, "completion_tokens": 4, "total_tokens": 35},
})


def _literal(name: bytes, value: bytes) -> bytes:
    # HPACK literal without indexing, new name (RFC 7541 §6.2.2); lengths stay below 127.
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


_REPLY_BLOCK = b"\x88" + b"".join(_literal(n, v) for n, v in (
    (b"content-type", b"application/json"),
    (b"x-request-id", b"req_0123456789abcdef0123456789abcdef"),
    (b"openai-processing-ms", b"212"),
    (b"openai-version", b"2020-10-01"),
    (b"x-ratelimit-limit-requests", b"10000"),
    (b"x-ratelimit-remaining-requests", b"9999"),
    (b"content-length", str(len(REPLY_BODY)).encode()),
))
def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + \
        struct.pack(">I", stream_id) + payload


def reply_frames(stream_id: int) -> bytes:
    """HEADERS (END_HEADERS) then DATA (END_STREAM) for one stream."""
    return _frame(1, 0x4, stream_id, _REPLY_BLOCK) + _frame(0, 0x1, stream_id, REPLY_BODY)


# A streamed answer as OpenAI sends it when asked for usage (the gateway asks, for its token
# accounting): `"usage":null` in every chunk, a usage chunk, [DONE].
STREAM_REQUEST = CLIENT_REQUEST.replace(b"Content-Length: %d" % len(CHAT_BODY),
                                        b"Content-Length: %d" % (len(CHAT_BODY) + 14)).replace(
    CHAT_BODY, CHAT_BODY[:-1] + b',"stream":true}')
_SSE_BLOCK = b"\x88" + b"".join(_literal(n, v) for n, v in (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"x-request-id", b"req_0123456789abcdef0123456789abcdef"),
    (b"openai-processing-ms", b"212"),
))
EVENT = (b'data: {"id":"chatcmpl-0123456789","object":"chat.completion.chunk","created":1760000000,'
         b'"model":"gpt-4o-mini","system_fingerprint":"fp_0123456789","usage":null,"choices":'
         b'[{"index":0,"delta":{"content":" word"},"logprobs":null,"finish_reason":null}]}\n\n')
STREAM_END = (b'data: {"id":"chatcmpl-0123456789","object":"chat.completion.chunk","created":'
              b'1760000000,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":31,'
              b'"completion_tokens":4,"total_tokens":35}}\n\ndata: [DONE]\n\n')

SERVER_PREFACE = _frame(4, 0, 0, struct.pack(">HI", 3, 1000)) + _frame(4, 0x1, 0, b"")


class FakeTransport:
    __slots__ = ("written", "chunks", "closed", "keep")

    def __init__(self, keep: bool = False) -> None:
        self.written = 0
        self.chunks: list[bytes] = []
        self.closed = False
        self.keep = keep

    def write(self, data: bytes) -> None:
        self.written += len(data)
        if self.keep:
            self.chunks.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class FakeLoop:
    """Just enough of an event loop: callbacks queue up until run_ready() runs them."""

    def __init__(self) -> None:
        self.ready: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        self.ready.append((callback, args))

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> None:
        pass  # timers (the deadline sweep, the stats tick) do not run in the harness

    def run_ready(self) -> None:
        while self.ready:
            batch, self.ready = self.ready, []
            for callback, args in batch:
                callback(*args)


class Pipeline:
    def __init__(self, clients: int = 64, codec: str = "native",
                 ingress_native: bool | None = None, **env: str) -> None:
        settings = load({"VELOX_UPSTREAM_ORIGIN": "https://upstream.invalid",
                         "VELOX_EGRESS_POOL_CONNECTIONS": "1", "VELOX_WORKERS": "1",
                         "VELOX_UPSTREAM_API_KEY": "sk-upstream",
                         "VELOX_NATIVE": "0" if codec == "framer" else "1", **env},
                        dotenv=None)
        self.loop = FakeLoop()
        self.worker = Worker(settings, 0, SharedStats(1, settings.tables), Limiter(None), None)
        self.worker.build(self.loop)  # type: ignore[arg-type]
        pool = self.worker.pool.pool  # type: ignore[attr-defined]  # the Upstream's H2Pool
        self.upstream_transport = FakeTransport()
        conn = H2Connection(pool, 0, make_codec(codec, b"upstream.invalid", b"https"))
        conn.connection_made(self.upstream_transport)  # type: ignore[arg-type]
        conn.data_received(SERVER_PREFACE + reply_frames(1))  # the warm-up request's answer
        assert conn.state is State.READY, "the upstream connection did not warm up"
        self.conn = conn
        if ingress_native is not None:  # one twin alone, the ingress parser: bench_ingress.py
            self.worker.ingress.native = ingress_native
        self.clients: list[tuple[ClientConnection, FakeTransport]] = []
        for _ in range(clients):
            client = ClientConnection(self.worker.ingress)
            transport = FakeTransport()
            client.connection_made(transport)  # type: ignore[arg-type]
            self.clients.append((client, transport))

    def send_requests(self) -> None:
        """Every client sends one request; the drain builds and writes the upstream frames."""
        for client, _ in self.clients:
            client.data_received(CLIENT_REQUEST)
        self.loop.run_ready()

    def answer_streams(self) -> None:
        """The upstream answers every open stream; the relay writes the client responses.

        Like a real server it first gives back the connection window the request bodies used.
        """
        sids = list(self.conn.streams)
        if not sids:
            return
        credit = _frame(8, 0, 0, struct.pack(">I", len(sids) * len(CHAT_BODY)))
        self.conn.data_received(credit + b"".join(reply_frames(sid) for sid in sids))
        self.loop.run_ready()

    def stream_round(self, events: int) -> None:
        """Every client asks for a stream; the upstream answers each with `events` events, one
        read per event carrying that event of every stream (as HTTP/2 multiplexes them), a
        loop pass after each read, then the usage chunk, [DONE] and the stream's end."""
        for client, _ in self.clients:
            client.data_received(STREAM_REQUEST)
        self.loop.run_ready()
        sids = list(self.conn.streams)
        credit = _frame(8, 0, 0, struct.pack(">I", len(sids) * len(STREAM_REQUEST)))
        self.conn.data_received(credit + b"".join(_frame(1, 0x4, sid, _SSE_BLOCK) for sid in sids))
        self.loop.run_ready()
        read = b"".join(_frame(0, 0, sid, EVENT) for sid in sids)
        for _ in range(events):
            self.conn.data_received(read)
            self.loop.run_ready()
        self.conn.data_received(b"".join(_frame(0, 0x1, sid, STREAM_END) for sid in sids))
        self.loop.run_ready()

    def round(self) -> None:
        self.send_requests()
        self.answer_streams()

    def responses_written(self) -> int:
        return sum(t.written for _, t in self.clients)
