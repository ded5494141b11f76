"""An OTLP/HTTP traces endpoint for benchmarks: it reads each export and answers 200 without
decoding it, so a traced gateway pays its real export (encoding, the HTTP POST, the answer) and
the sink's own CPU stays out of the gateway's figures (it runs in the bench's process).

A closed port is no stand-in: the exporter then fails each batch and retries for up to its
10 s timeout, the batch processor's queue fills, and most spans are dropped before anyone
encodes them, so the gateway looks cheaper than with a collector that answers.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Sink:
    """Answers every POST with an empty ExportTraceServiceResponse (zero bytes of protobuf);
    counts the exports and their bytes."""

    def __init__(self) -> None:
        self.exports = 0
        self.bytes = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a collector answers the exporter

            def do_POST(self) -> None:
                size = int(self.headers.get("Content-Length", "0"))
                self.rfile.read(size)
                with outer.lock:
                    outer.exports += 1
                    outer.bytes += size
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="otlp-sink",
                                       daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {"exports": self.exports, "bytes": self.bytes}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
