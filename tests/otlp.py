"""A real OTLP/HTTP traces receiver for tests: an HTTP server on 127.0.0.1 decoding the
protobuf that the official exporter sends (opentelemetry-proto), keeping every span."""

from __future__ import annotations

import gzip
import socket
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

SERVER, CLIENT = 2, 3  # SpanKind in the protocol


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


class Receiver:
    """An OTLP/HTTP traces endpoint on 127.0.0.1 keeping every span it was sent."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.requests = 0
        self.cond = threading.Condition()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                assert self.path == "/v1/traces", self.path
                assert self.headers["Content-Type"] == "application/x-protobuf"
                outer.take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def take(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    found.append({
                        "name": s.name, "kind": s.kind, "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                        "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                        "attrs": {a.key: _value(a.value) for a in s.attributes},
                        "events": [(e.name, e.time_unix_nano,
                                    {a.key: _value(a.value) for a in e.attributes})
                                   for e in s.events],
                        "links": [(link.trace_id.hex(), link.span_id.hex())
                                  for link in s.links],
                        "status": s.status.code, "resource": resource,
                        "scope": ss.scope.name})
        with self.cond:
            self.requests += 1
            self.spans.extend(found)
            self.cond.notify_all()

    def wait_for(self, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.spans) >= count, timeout):
                raise AssertionError(f"the receiver got {len(self.spans)} spans, not {count}")
            return list(self.spans)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def silent_collector() -> tuple[socket.socket, threading.Event, list[socket.socket],
                                 threading.Thread]:
    """A port that accepts connections and never answers (a hung collector). Stop it by
    closing the listener, joining the thread, then closing what it held."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    accepted = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            held.append(conn)
            accepted.set()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    return sock, accepted, held, thread


def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return int(port)
